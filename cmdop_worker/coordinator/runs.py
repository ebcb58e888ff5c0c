"""Starting a run: validate the request, store the run, enqueue turn 1.

Called by the `cmdop.run` task and by `ask_machine` (child runs). A request that does
not validate raises `InvalidRequest` naming each bad field, and nothing is stored. The
run id is the caller's, or made from the task id (`run_id_for`): a redelivered
`cmdop.run` finds its own run already stored and returns the same id instead of
starting a second one.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from cmdop_worker.config import AgentProfile
from cmdop_worker.core.intake import parse_request
from cmdop_worker.errors import DuplicateRun, InvalidRequest
from cmdop_worker.models import Message, RunRequest
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.keys import advance_member, run_member
from cmdop_worker.state.store import ADVANCE_GRACE_MS, ParentLink, RunState

log = logging.getLogger(__name__)


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
        max_turns=request.max_turns or default_max_turns(rt, agent),
        parallel_tools=agent.parallel_tools and request.parallel_tools,
        tool_tags=request.tool_tags if request.tool_tags is not None else list(agent.tool_tags),
        token_budget=request.token_budget or rt.settings.run_token_budget,
        history=history,
        started_ms=started,
        deadline_ms=started + int(timeout_s * 1000),
        parent=parent,
    )


def default_max_turns(rt: Runtime, agent: AgentProfile | None) -> int:
    """The turn limit of a run of `agent` that names none itself."""
    return (agent.max_turns if agent is not None else None) or rt.settings.max_turns


def run_id_for(task_id: str) -> str:
    """The run id of a `cmdop.run` task whose request names none: the task id, in the
    shape the client mints (32 hex digits) when it is a UUID, as the ids of Flower's REST
    API and of a plain `send_task` are (with dashes); any other task id as it is."""
    try:
        return uuid.UUID(task_id).hex
    except ValueError:
        return task_id


def start_run(
    rt: Runtime, payload: Any, *, fallback_id: str, parent: ParentLink | None = None
) -> str:
    request = parse_request(payload)
    run_id = request.run_id or run_id_for(fallback_id)
    state = initial_state(rt, request, run_id, parent).model_copy(update={"origin": fallback_id})
    if not rt.store.create(state):
        existing = rt.store.load(run_id)
        if existing is None or existing.origin != fallback_id:
            raise DuplicateRun(f"run_id: a run with id '{run_id}' already exists")
        log.info("run %s already started (redelivered request)", run_id)
        if existing.turn == 0 and existing.status == "running":
            # The first delivery may have died before enqueueing turn 1: do it again
            # (a turn runs once however often it is enqueued).
            _launch(rt, existing)
        return run_id
    _launch(rt, state)
    log.info("run %s started (agent %s, model %s)", run_id, request.agent, state.model)
    return run_id


def _launch(rt: Runtime, state: RunState) -> None:
    from cmdop_worker.outcomes import enqueue_turn

    rt.store.schedule(run_member(state.run_id), state.deadline_ms)
    # Until turn 1 takes its lease, this entry lets the watchdog enqueue it if need be.
    rt.store.schedule(advance_member(state.run_id, 1), now_ms() + ADVANCE_GRACE_MS)
    enqueue_turn(state.run_id, 1)
