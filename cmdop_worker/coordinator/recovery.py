"""Taking over abandoned work: the watchdog's `advance:<run>:<n>` entries.

The entry exists from the moment turn n may start (scheduled by `runs.start_run` for
turn 1, and by the barrier script that completes turn n-1) until turn n's executor has
carried out its step (`lease.TurnLease` keeps it from coming due meanwhile and deletes
it at the end). So it comes due only when nobody is working on the turn: the enqueue
was lost, or the executor died. `resume_turn` then looks at the stored state:

- turn n has not stored its reply: enqueue turn n again. The entry stays, so this
  repeats every lease until a live executor takes the turn.
- turn n stored a reply with tool calls but its executor died while dispatching them:
  the barrier and the turn's deadline are declared again, every machine call neither
  answered nor started is sent again (a machine starts a call at most once:
  `RunStore.start_call`), and other unanswered calls are answered "not run".
- turn n stored a reply that needs another turn (an output retry): enqueue turn n+1.
- the run ended but its terminal event is missing (the executor died while ending it):
  emit the terminal event from the stored result.
- anything else means the run moved on: the entry is dropped.
"""

from __future__ import annotations

import logging
from typing import Any

from cmdop_worker.celery_app import app
from cmdop_worker.coordinator import local_tools
from cmdop_worker.coordinator.finish import result_of, terminal_event
from cmdop_worker.core import tools
from cmdop_worker.models import (
    RunError,
    RunResult,
    StopReason,
    ToolCall,
    ToolOutcome,
)
from cmdop_worker.outcomes import enqueue_turn, record
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.keys import advance_member, machine_queue, turn_member
from cmdop_worker.state.presence import online_machines
from cmdop_worker.state.store import ADVANCE_GRACE_MS, PendingCall, RunState

log = logging.getLogger(__name__)
_LOST_ENDING = "the coordinator stopped while ending the run"


def resume_turn(rt: Runtime, run_id: str, turn: int) -> bool:
    """Act on a due `advance:` entry; True when the entry is done with."""
    state = rt.store.load(run_id)
    if state is None:
        return True
    if state.status != "running":
        emit_missing_terminal(rt, state)
        return True
    if state.turn == turn - 1:
        log.warning("run %s: turn %s was abandoned; enqueueing it again", run_id, turn)
        enqueue_turn(run_id, turn)
        return False
    if state.turn == turn and state.awaiting:
        redispatch(rt, state, turn)
    elif state.turn == turn:
        rt.store.schedule(advance_member(run_id, turn + 1), now_ms() + ADVANCE_GRACE_MS)
        enqueue_turn(run_id, turn + 1)
    return True


def redispatch(rt: Runtime, state: RunState, turn: int) -> None:
    """Finish the dispatch of a turn whose executor died part way through it."""
    run_id = state.run_id
    log.warning("run %s: the dispatch of turn %s was cut short; completing it", run_id, turn)
    deadline = {turn_member(run_id, turn): max(p.deadline_ms for p in state.awaiting)}
    if rt.store.open_turn(run_id, turn, len(state.awaiting), schedule=deadline):
        enqueue_turn(run_id, turn + 1)
        return
    answered = rt.store.outcomes(run_id, turn)
    online = {p.machine for p in online_machines(rt.redis, rt.keys)}
    inputs = _tool_inputs(state)
    for call in state.awaiting:
        if call.tool_use_id in answered or rt.store.was_started(run_id, call.tool_use_id):
            continue
        if call.machine in online and call.tool not in tools.NAMES:
            _send(state, turn, call, inputs.get(call.tool_use_id, {}))
        elif not _children_started(rt, run_id, call):
            outcome = ToolOutcome(
                tool_use_id=call.tool_use_id,
                tool=call.tool,
                machine=call.machine,
                status="lost",
                output="not run: the coordinator stopped while dispatching this call",
            )
            record(rt, run_id, turn, outcome)


def _tool_inputs(state: RunState) -> dict[str, Any]:
    last = state.history[-1] if state.history else None
    if last is None or last.role != "assistant" or isinstance(last.content, str):
        return {}
    return {b["id"]: b.get("input") for b in last.content if b.get("type") == "tool_use"}


def _children_started(rt: Runtime, run_id: str, call: PendingCall) -> bool:
    key = rt.keys.ask(run_id, call.tool_use_id, "hosts")
    return call.tool in tools.NAMES and bool(rt.redis.exists(key))


def _send(state: RunState, turn: int, call: PendingCall, tool_input: Any) -> None:
    assert call.machine is not None
    payload = ToolCall(
        run_id=state.run_id,
        turn=turn,
        tool_use_id=call.tool_use_id,
        tool=call.tool,
        machine=call.machine,
        input={**(tool_input if isinstance(tool_input, dict) else {}), "machine": call.machine},
        deadline_ms=min(call.deadline_ms, state.deadline_ms),
        run_deadline_ms=state.deadline_ms,
    )
    app.send_task(
        "cmdop.tool",
        kwargs={"call": payload.model_dump(mode="json")},
        queue=machine_queue(call.machine),
        task_id=f"{state.run_id}.{call.tool_use_id}",
        kwargsrepr=repr(
            {"run_id": state.run_id, "turn": turn, "tool": call.tool, "machine": call.machine}
        ),
    )


def emit_missing_terminal(rt: Runtime, state: RunState) -> None:
    """Finish the ending of a run whose coordinator died part-way through it: the
    terminal event (the event script drops it if one was written meanwhile) and the
    parent's answer (stored once, so answering again is harmless)."""
    result = rt.store.load_result(state.run_id)
    if not rt.redis.exists(rt.keys.terminal(state.run_id)):
        if result is None:
            result = _result_of(state)
            rt.store.store_result(result)
        has_schema = state.request.output_schema is not None
        event_type, data = terminal_event(result, has_schema=has_schema)
        log.warning("run %s ended without its terminal event; writing it now", state.run_id)
        rt.events.emit(state.run_id, event_type, state.turn, data)
    if state.parent is not None and result is not None:
        local_tools.answer_parent(rt, state.parent, result)


def _result_of(state: RunState) -> RunResult:
    status = state.status if state.status != "running" else "error"
    stop_reason: StopReason = "error"
    if status == "done":
        stop_reason = "end_turn"
    elif status == "cancelled":
        stop_reason = "cancelled"
    error = None if status != "error" else RunError(kind="lost", message=_LOST_ENDING)
    return result_of(state, status, stop_reason, text=state.text, error=error)
