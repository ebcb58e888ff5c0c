"""Starting a run: validate the request, store the run, enqueue turn 1.

Called by the `cmdop.run` task and by `ask_machine` (child runs). A request that does
not validate raises `InvalidRequest` naming each bad field, and nothing is stored. The
run id is the caller's, or the task id: a redelivered `cmdop.run` finds its own run
already stored and returns the same id instead of starting a second one.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from cmdop_worker.errors import DuplicateRun, InvalidRequest
from cmdop_worker.models import Message, RunRequest
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.store import ParentLink, RunState

log = logging.getLogger(__name__)


def parse_request(payload: Any) -> RunRequest:
    if isinstance(payload, RunRequest):
        return payload
    if not isinstance(payload, dict):
        raise InvalidRequest(f"request: expected a JSON object, got {type(payload).__name__}")
    try:
        return RunRequest.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "request"
        problems.append(f"{where}: {error['msg']}")
    return "invalid run request: " + "; ".join(problems[:10])


def initial_state(
    rt: Runtime, request: RunRequest, run_id: str, parent: ParentLink | None = None
) -> RunState:
    agent = rt.agents.get(request.agent)
    if agent is None:
        known = ", ".join(sorted(rt.agents))
        raise InvalidRequest(f"agent: unknown agent '{request.agent}' (known: {known})")
    timeout_s = min(request.timeout_s or rt.settings.run_timeout_s, 3600.0)
    started = now_ms()
    if request.messages is not None:
        history = list(request.messages)
    else:
        history = [Message(role="user", content=request.prompt or "")]
    return RunState(
        run_id=run_id,
        request=request,
        model=rt.settings.resolve_model(request.model or agent.model),
        system_prompt=agent.system_prompt,
        max_turns=request.max_turns or agent.max_turns or rt.settings.max_turns,
        parallel_tools=agent.parallel_tools,
        tool_tags=request.tool_tags if request.tool_tags is not None else list(agent.tool_tags),
        token_budget=request.token_budget or rt.settings.run_token_budget,
        history=history,
        started_ms=started,
        deadline_ms=started + int(timeout_s * 1000),
        parent=parent,
    )


def start_run(
    rt: Runtime, payload: Any, *, fallback_id: str, parent: ParentLink | None = None
) -> str:
    request = parse_request(payload)
    run_id = request.run_id or fallback_id
    state = initial_state(rt, request, run_id, parent).model_copy(update={"origin": fallback_id})
    if not rt.store.create(state):
        existing = rt.store.load(run_id)
        if existing is None or existing.origin != fallback_id:
            raise DuplicateRun(f"run_id: a run with id '{run_id}' already exists")
        log.info("run %s already started (redelivered request)", run_id)
        return run_id
    rt.store.schedule(f"run:{run_id}", state.deadline_ms)
    from cmdop_worker.dispatch import enqueue_turn

    enqueue_turn(run_id, 1)
    log.info("run %s started (agent %s, model %s)", run_id, request.agent, state.model)
    return run_id
