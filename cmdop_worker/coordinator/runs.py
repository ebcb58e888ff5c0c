"""Starting a run: validate the request, claim its thread, store the run, enqueue turn 1.

Called by the `cmdop.run` task and by `ask_machine` (child runs). A request that does
not validate raises `InvalidRequest` naming each bad field, and nothing is stored (a
`budget_usd` for a model without a known price is refused too). The
run id is the caller's, or made from the task id (`run_id_for`): a redelivered
`cmdop.run` finds its own run already stored and returns the same id instead of
starting a second one. A request on a thread (`thread_id`) first claims it
(`state.threads`): the run starts from the thread's history, or waits, steers the
running run or is refused, as its `on_busy` says.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from typing import Any, assert_never

from cmdop_worker.config import AgentProfile
from cmdop_worker.core.intake import parse_request
from cmdop_worker.errors import DuplicateRun, InvalidRequest, ThreadBusy
from cmdop_worker.messages import enqueue_turn, send_start
from cmdop_worker.models import CancelRequest, Message, RunRequest, thinking_param
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state import starts
from cmdop_worker.state.keys import advance_member, run_member
from cmdop_worker.state.store import ADVANCE_GRACE_MS, ParentLink, RunState
from cmdop_worker.state.threads import Claim

log = logging.getLogger(__name__)


def initial_state(
    rt: Runtime,
    request: RunRequest,
    run_id: str,
    parent: ParentLink | None = None,
    *,
    sent_ms: int | None = None,
) -> RunState:
    """The run as it starts. Its deadline counts from `sent_ms` (when its client sent
    it), or from now when it was not stamped or a clock put it in the future."""
    agent = rt.agents.get(request.agent)
    if agent is None:
        known = ", ".join(sorted(rt.agents))
        raise InvalidRequest(f"agent: unknown agent '{request.agent}' (known: {known})")
    model = rt.settings.resolve_model(request.model or agent.model)
    if request.budget_usd is not None:
        _check_priced(model)
    timeout_s = min(request.timeout_s or rt.settings.run_timeout_s, 3600.0)
    started = now_ms()
    since = min(sent_ms, started) if sent_ms is not None else started
    if request.messages is not None:
        history = list(request.messages)
    else:
        history = [Message(role="user", content=request.prompt or "")]
    return RunState(
        run_id=run_id,
        request=request,
        model=model,
        system_prompt=agent.system_prompt,
        max_turns=request.max_turns or default_max_turns(rt, agent),
        parallel_tools=agent.parallel_tools and request.parallel_tools,
        tool_tags=request.tool_tags if request.tool_tags is not None else list(agent.tool_tags),
        token_budget=request.token_budget or rt.settings.run_token_budget,
        history=history,
        started_ms=started,
        deadline_ms=since + int(timeout_s * 1000),
        parent=parent,
        thinking=thinking_param(request.thinking or agent.thinking),
        fallback_models=[rt.settings.resolve_model(m) for m in agent.fallback_models],
        copy_key=secrets.token_hex(16),
    )


def _check_priced(model: str) -> None:
    """A dollar budget can be kept only when the model's calls can be priced."""
    from cmdop_worker.llm.pricing import has_price

    if not has_price(model):
        raise InvalidRequest(
            f"budget_usd: model '{model}' has no known price (genai-prices), so a budget "
            "cannot be kept; leave budget_usd out or choose a priced model"
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
    rt: Runtime,
    payload: Any,
    *,
    fallback_id: str,
    parent: ParentLink | None = None,
    sent_ms: int | None = None,
) -> str:
    """Start the run `payload` asks for and return its id. A request on a busy thread
    returns the id of the run it waits as (enqueue, interrupt) or steered (steer). One
    taken only after its deadline (`sent_ms` + its timeout: no coordinator was up)
    ends CANCELLED by the timeout at its first loop boundary, before the model is asked."""
    try:
        request = parse_request(payload)
        run_id = request.run_id or run_id_for(fallback_id)
        state = initial_state(rt, request, run_id, parent, sent_ms=sent_ms)
    except InvalidRequest:
        _drop_from_thread(rt, payload)
        raise
    state = state.model_copy(update={"origin": fallback_id})
    if request.thread_id is not None:
        on_thread = _claim_thread(rt, request, run_id)
        if isinstance(on_thread, str):
            return on_thread
        state = continued(state, on_thread)
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
    if state.deadline_ms <= now_ms():  # its turn 1 ends it before asking the model
        late_s = (now_ms() - state.deadline_ms) / 1000
        log.warning("run %s: taken %.1fs past its deadline; it ends unrun", run_id, late_s)
    _launch(rt, state)
    log.info("run %s started (agent %s, model %s)", run_id, request.agent, state.model)
    return run_id


def continued(state: RunState, prior: list[Message]) -> RunState:
    """A thread's new run: the thread's history, then the run's own messages. The
    turn-1 tool allowlist was the conversation's first turn's, long past."""
    if not prior:
        return state
    return state.model_copy(update={"history": [*prior, *state.history], "tool_tags": None})


def _claim_thread(rt: Runtime, request: RunRequest, run_id: str) -> list[Message] | str:
    """The history to start from, or the run id to answer with when the thread is busy
    (`state.threads` decides). Raises `ThreadBusy` for on_busy=reject."""
    thread_id = str(request.thread_id)
    body = {**request.model_dump(mode="json", exclude_none=True), "run_id": run_id}
    claimed = rt.threads.claim(thread_id, run_id, request.on_busy, body, now_ms=now_ms())
    if claimed.kick is not None:  # a queued run whose start was lost: send it again
        starts.expect(rt.redis, rt.keys, claimed.kick, now_ms=now_ms())  # kept until handled
        send_start(claimed.kick)
    busy_with = claimed.active
    match claimed.claim:
        case Claim.STARTED | Claim.EXISTS:
            return claimed.history
        case Claim.QUEUED:
            log.info("run %s waits for thread %s (busy with %s)", run_id, thread_id, busy_with)
            return run_id
        case Claim.INTERRUPTS:
            log.info("run %s interrupts run %s on thread %s", run_id, busy_with, thread_id)
            if busy_with is not None:
                cancel = CancelRequest(channel="ui", reason=f"interrupted by run {run_id}")
                # The run may have claimed the thread and not stored its state yet.
                rt.store.request_cancel(busy_with, cancel, now_ms=now_ms(), before_start=True)
            return run_id
        case Claim.STEERED:
            log.info("run %s steers run %s on thread %s", run_id, busy_with, thread_id)
            return str(busy_with)
        case Claim.BUSY:
            raise ThreadBusy(
                f"thread_id: thread '{thread_id}' is busy with run {busy_with} "
                "(on_busy is reject; enqueue, interrupt or steer would not refuse it)"
            )
        case _:
            assert_never(claimed.claim)


def _drop_from_thread(rt: Runtime, payload: Any) -> None:
    """A request that waited for its thread and can no longer start (its agent was
    removed, say) must not hold the thread forever: take it out and start the next."""
    if not isinstance(payload, dict):
        return
    thread_id, run_id = payload.get("thread_id"), payload.get("run_id")
    if isinstance(thread_id, str) and isinstance(run_id, str):
        following = rt.threads.drop_queued(thread_id, run_id)
        if following is not None and following.get("run_id") != run_id:
            starts.expect(rt.redis, rt.keys, following, now_ms=now_ms())  # kept until handled
            send_start(following)


def _launch(rt: Runtime, state: RunState) -> None:
    rt.store.schedule(run_member(state.run_id), state.deadline_ms)
    # Until turn 1 takes its lease, this entry lets the watchdog enqueue it if need be.
    rt.store.schedule(advance_member(state.run_id, 1), now_ms() + ADVANCE_GRACE_MS)
    enqueue_turn(state.run_id, 1)
