"""Taking over abandoned work: the watchdog's `advance:<run>:<n>` entries.

The entry exists from the moment turn n may start (scheduled by `runs.start_run` for
turn 1, and by the barrier script that completes turn n-1) until turn n's executor has
carried out its step (`lease.TurnLease` keeps it from coming due meanwhile and deletes
it at the end). So it comes due only when nobody is working on the turn: the enqueue
was lost, or the executor died. An entry come due while the turn's lock is held (its
executor alive: a machine moved the entry, as it may write the set) waits a lease.
`resume_turn` then looks at the stored state:

- turn n has not stored its reply: enqueue turn n again. The entry stays, so this
  repeats every lease until a live executor takes the turn. Not while a call of turn
  n-1 has no outcome: then the entry came early (moved by a machine) and is dropped.
- turn n stored a reply with tool calls but its executor died while dispatching them:
  the barrier and the turn's deadline are declared again, and every call neither
  answered nor started is sent again — a machine call to its machine (which starts a
  call at most once: `RunStore.start_call`; a fan-out's copy only once its batch is
  out), a coordinator tool to a coordinator — or,
  its machine offline, answered "offline"; the run having a cancel request (any
  channel), answered "cancelled … before it started". A sequential turn is sent on one call at a
  time: only the call out now, if it never started (the same entry, scheduled by the
  barrier when it hands out a call, covers a sender that died before sending it), with
  its deadline counted from this sending — or, the run having a cancel request,
  answered "cancelled … before it started" as the barrier would have had it.
- turn n stored a reply that needs another turn (an output retry): enqueue turn n+1.
- the run ended but its terminal event is missing (the executor died while ending it):
  emit the terminal event from the stored result.
- anything else means the run moved on: the entry is dropped.
"""

from __future__ import annotations

import logging
from typing import Any

from cmdop_worker import tracing
from cmdop_worker.coordinator import local_tools
from cmdop_worker.coordinator.calls import machine_call, publish_calls
from cmdop_worker.coordinator.finish import result_of, terminal_data
from cmdop_worker.core import tools
from cmdop_worker.core.results import unanswered_outcome
from cmdop_worker.core.routing import ToMachine
from cmdop_worker.messages import enqueue_turn, local_tool_message, send
from cmdop_worker.models import RunError, RunResult, StopReason, ToolCall
from cmdop_worker.outcomes import record, send_in_order
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.keys import advance_member, turn_member
from cmdop_worker.state.presence import online_machines
from cmdop_worker.state.sent import mark_sent
from cmdop_worker.state.store import (
    ADVANCE_GRACE_MS,
    PendingCall,
    QueuedCall,
    RunState,
    tool_inputs,
)

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
    if rt.redis.exists(rt.keys.turn(run_id, turn, "lock")):
        # Its executor is alive (it renews the lock): the entry came due early, as a
        # machine may move it (it may write the set). Look again a lease later.
        return False
    if state.turn == turn - 1 and _unanswered(rt, state):
        # Turn n may start only once turn n-1 has every outcome (the barrier then
        # schedules this entry): one come due before was moved by a machine. Dropped.
        log.warning("run %s: turn %s's entry came due before its turn could start", run_id, turn)
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


def _unanswered(rt: Runtime, state: RunState) -> bool:
    """Whether a call of the run's current turn has no outcome yet."""
    if not state.awaiting:
        return False
    stored = rt.store.outcomes(state.run_id, state.turn)
    return any(call.tool_use_id not in stored for call in state.awaiting)


def redispatch(rt: Runtime, state: RunState, turn: int) -> None:
    """Finish the dispatch of a turn whose executor died part way through it (or send
    on a sequential turn whose next call's sender died)."""
    run_id = state.run_id
    log.warning("run %s: the dispatch of turn %s was cut short; completing it", run_id, turn)
    deadline = {turn_member(run_id, turn): max(p.deadline_ms for p in state.awaiting)}
    if rt.store.open_turn(run_id, turn, len(state.awaiting), schedule=deadline):
        enqueue_turn(run_id, turn + 1)
        return
    online = {p.machine for p in online_machines(rt.redis, rt.keys)}
    if not state.parallel_tools:
        _resend_current(rt, state, turn, online)
        return
    answered = rt.store.outcomes(run_id, turn)
    inputs = tool_inputs(state)
    cancel = rt.store.cancel_request(run_id)
    # A fan-out's copies of a batch not yet out: whoever ends the batch before sends them.
    waiting = rt.store.batch_waiting(run_id, turn, [c.tool_use_id for c in state.awaiting])
    for call in state.awaiting:
        if call.tool_use_id in answered or call.tool_use_id in waiting:
            continue
        if rt.store.was_started(run_id, call.tool_use_id):
            continue
        tool_input = inputs.get(call.tool_use_id, {})
        if cancel is not None:  # a cancel of any channel starts no further call
            answer = unanswered_outcome(call, "cancel", started=False, reason=cancel.reason)
            record(rt, run_id, turn, answer, tool_input=tool_input)
        elif call.tool in tools.NAMES:  # run once: an ask starts its children once
            _send_local(run_id, turn, call)
        elif call.machine in online:
            _send(rt, state, turn, call, tool_input)
        else:
            record(rt, run_id, turn, unanswered_outcome(call, "offline"), tool_input=tool_input)


def _resend_current(rt: Runtime, state: RunState, turn: int, online: set[str]) -> None:
    """A sequential turn goes on from the call out now, one call at a time: that call
    is sent again only if it neither started nor has an outcome (answered instead when
    the run has a cancel request); the rest follow as each is answered."""
    run_id = state.run_id
    first = state.awaiting[0].tool_use_id
    if rt.store.queued_call(run_id, turn, first) is None:
        _store_sequence(rt, state, turn)  # the turn's order was never stored
    current = rt.store.current_call(run_id, turn)
    if current is None or rt.store.was_started(run_id, current):
        return
    queued = rt.store.queued_call(run_id, turn, current)
    if queued is None or rt.store.outcome(run_id, turn, current) is not None:
        return
    cancel = rt.store.cancel_request(run_id)
    call = queued.call
    if cancel is None and queued.send == "machine" and call and call.machine not in online:
        pending = next((p for p in state.awaiting if p.tool_use_id == current), None)
        if pending is not None:
            offline = unanswered_outcome(pending, "offline")
            record(rt, run_id, turn, offline, tool_input=queued.input)
        return
    again = rt.store.hand_out_again(run_id, turn, queued)
    if again.call is not None:  # its record, as stored with the turn (written anew)
        mark_sent(rt.redis, rt.keys, [again.call], ttl_s=rt.store.ttl_s)
    send_in_order(rt, run_id, turn, again, cancel)


def _store_sequence(rt: Runtime, state: RunState, turn: int) -> None:
    """Store the order of a sequential turn whose dispatch stored none: its calls
    without an outcome, in the model's order, the first of them out now."""
    answered = rt.store.outcomes(state.run_id, turn)
    inputs = tool_inputs(state)
    sequence = [
        _queued(rt, state, turn, call, inputs.get(call.tool_use_id))
        for call in state.awaiting
        if call.tool_use_id not in answered
    ]
    if sequence:
        machine_calls = [q.call for q in sequence if q.call is not None]
        mark_sent(rt.redis, rt.keys, machine_calls, ttl_s=rt.store.ttl_s)
        rt.store.open_turn(state.run_id, turn, len(state.awaiting), sequence=sequence)


def _queued(
    rt: Runtime, state: RunState, turn: int, call: PendingCall, tool_input: Any
) -> QueuedCall:
    # No timeout of its own is known here: each keeps the deadline planned at dispatch.
    args = tool_input if isinstance(tool_input, dict) else {}
    if call.tool in tools.NAMES:
        return QueuedCall(
            tool_use_id=call.tool_use_id,
            tool=call.tool,
            send="coordinator",
            input=args,
            deadline_ms=call.deadline_ms,
        )
    if call.machine is None:  # refused at dispatch, and its answer lost with it
        answer = unanswered_outcome(call, "dispatch_lost")
        return QueuedCall(
            tool_use_id=call.tool_use_id, tool=call.tool, send="answer", input=args, answer=answer
        )
    payload = _tool_call(rt, state, turn, call, args)
    return QueuedCall(
        tool_use_id=call.tool_use_id, tool=call.tool, send="machine", input=args, call=payload
    )


def _send_local(run_id: str, turn: int, call: PendingCall) -> None:
    """A coordinator tool sent again as a sequential turn sends one: the same message,
    with the deadline the turn gave it and the trace context of whoever re-sends it."""
    when, headers = call.deadline_ms, tracing.trace_headers()
    send(local_tool_message(run_id, turn, call.tool_use_id, deadline_ms=when, headers=headers))


def _send(rt: Runtime, state: RunState, turn: int, call: PendingCall, tool_input: Any) -> None:
    # Recorded as sent (what is sent now), then sent as a turn sends its calls, with the
    # trace context of whoever re-sends it (as `_send_local`).
    call_message = _tool_call(rt, state, turn, call, tool_input)
    publish_calls(rt, [call_message], headers=tracing.trace_headers())


def _tool_call(
    rt: Runtime, state: RunState, turn: int, call: PendingCall, tool_input: Any
) -> ToolCall:
    assert call.machine is not None
    args = {**(tool_input if isinstance(tool_input, dict) else {}), "machine": call.machine}
    route = ToMachine(call.tool_use_id, call.tool, call.machine, args, call.deadline_ms)
    return machine_call(state, turn, route, rt.settings.tool_grace_ms)


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
        data = terminal_data(result, has_schema=has_schema)
        log.warning("run %s ended without its terminal event; writing it now", state.run_id)
        rt.events.emit(state.run_id, state.turn, data)
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
