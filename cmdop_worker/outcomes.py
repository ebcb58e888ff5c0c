"""A tool call's outcome, stored once through the turn barrier, by whoever answers it;
and a sequential turn handed on to its next call.

Both sides of a call write here: the machine worker that ran it, the coordinator for
a call it refused or ran itself, the watchdog and the liveness probe for a call whose
machine went quiet (the words of an outcome its tool never gave: `core.results`).
`record` stores the outcome with its TOOL_END (and, given the call's input, the
TOOL_START of a call answered without starting: written only if it never started, so
every TOOL_END has exactly one TOOL_START) in one script. The writer whose outcome
completes the turn enqueues the next one, so a turn advances exactly once whichever
side finishes last.

In a sequential turn (`parallel_tools=false`) the writer whose outcome was the call out
now sends the next call (`send_in_order`, also recovery's way of going on): a machine
sends another machine's call by way of a coordinator (`hand_on`), so the calls run
one at a time in the model's order, whoever answers each; each is given its own time
as it is sent (a wait for a person before it eats none of it), and once the run has a
cancel request, any channel, the calls not yet sent are answered instead, never
started. It lives here, not in `coordinator/`, because machines hand on too.

A fan-out sent in batches goes on the same way: the writer whose outcome ended the
batch out sends the next (`send_batch`; a machine hands another machine's copy on by
way of a coordinator), or answers it "cancelled" once the run has a cancel request, so
an operation cancel starts no further batch.

The messages it sends on are built and sent by `messages`.
"""

from __future__ import annotations

from typing import Any

from cmdop_worker.core.event_data import ToolEndData, ToolStartData
from cmdop_worker.core.results import Call, unanswered_outcome
from cmdop_worker.core.tools import cap_output
from cmdop_worker.messages import (
    enqueue_turn,
    hand_on_message,
    local_tool_message,
    send,
    tool_message,
)
from cmdop_worker.models import CancelRequest, ToolOutcome
from cmdop_worker.runtime import Runtime
from cmdop_worker.state.barrier import Handed, HandedBatch
from cmdop_worker.state.keys import advance_member
from cmdop_worker.state.store import QueuedCall, Recorded


def record(
    rt: Runtime,
    run_id: str,
    turn: int,
    outcome: ToolOutcome,
    *,
    tool_input: Any = None,
) -> Recorded:
    """Store an outcome once, with its TOOL_END (and a TOOL_START first, given the
    `tool_input` of a call that may never have started); the writer that completes the
    turn enqueues the next, the one that answered a sequential turn's call out sends
    the call after it."""
    recorded, handed = _record_one(rt, run_id, turn, outcome, tool_input)
    if isinstance(handed, HandedBatch):
        send_batch(rt, run_id, turn, handed)
    elif handed is not None:
        send_in_order(rt, run_id, turn, handed.call, handed.cancel)
    if handed is not None:
        # Sent: the watchdog's resend entry (for a sender that died) is not needed.
        rt.store.unschedule(advance_member(run_id, turn))
    return recorded


def _record_one(
    rt: Runtime, run_id: str, turn: int, outcome: ToolOutcome, tool_input: Any
) -> tuple[Recorded, Handed | HandedBatch | None]:
    outcome = _capped(rt, outcome)
    limit = rt.settings.event_output_max_chars
    end = rt.events.frame(run_id, turn, ToolEndData.of(outcome, max_output_chars=limit))
    start = None
    if tool_input is not None:
        data = ToolStartData.of(outcome, machine=outcome.machine, input=tool_input)
        start = rt.events.frame(run_id, turn, data)
    recorded, handed = rt.store.record_outcome(run_id, turn, outcome, [end], start=start)
    if recorded is Recorded.ADVANCE:
        enqueue_turn(run_id, turn + 1)
    return recorded, handed


def send_in_order(
    rt: Runtime, run_id: str, turn: int, call: QueuedCall, cancel: CancelRequest | None = None
) -> None:
    """Send a sequential turn's call out now where it runs. One answered here instead
    (refused, or any call once the run has a cancel request: it never starts) hands out
    the call after it, which goes the same way, until one is sent or none is left."""
    handed = _send_queued(rt, run_id, turn, call, cancel)
    while isinstance(handed, Handed):
        handed = _send_queued(rt, run_id, turn, handed.call, handed.cancel)
    if isinstance(handed, HandedBatch):
        send_batch(rt, run_id, turn, handed)


def send_batch(rt: Runtime, run_id: str, turn: int, batch: HandedBatch) -> None:
    """Send a fan-out's next batch to its machines (a machine sends another machine's
    copy by way of a coordinator), or, the run having a cancel request, answer each copy
    "cancelled ... before it started" (which hands out the batch after it, answered the
    same way)."""
    pending: list[HandedBatch] = [batch]
    while pending:
        handed = pending.pop()
        for queued in handed.calls:
            if handed.cancel is not None:
                machine = queued.call.machine if queued.call is not None else None
                called = Call(queued.tool_use_id, queued.tool, machine)
                why = handed.cancel.reason
                answer = unanswered_outcome(called, "cancel", started=False, reason=why)
                more = _record_one(rt, run_id, turn, answer, queued.input or {})[1]
                if isinstance(more, HandedBatch):
                    pending.append(more)
            elif queued.call is not None and rt.settings.machine not in (None, queued.call.machine):
                send(hand_on_message(run_id, turn, queued.tool_use_id, headers=queued.headers))
            else:
                send_tool_call(queued)


def _send_queued(
    rt: Runtime, run_id: str, turn: int, call: QueuedCall, cancel: CancelRequest | None
) -> Handed | HandedBatch | None:
    """Send one call, or answer it; the call handed out after an answer is returned."""
    if call.send == "answer" and call.answer is not None:
        return _record_one(rt, run_id, turn, call.answer, call.input)[1]
    if cancel is not None:
        machine = call.call.machine if call.call is not None else None
        called = Call(call.tool_use_id, call.tool, machine)
        answer = unanswered_outcome(called, "cancel", started=False, reason=cancel.reason)
        return _record_one(rt, run_id, turn, answer, {} if call.input is None else call.input)[1]
    if call.send == "machine" and call.call is not None:
        if rt.settings.machine not in (None, call.call.machine):
            # A machine pushes onto its own queue and the continuation queue only (`state.acl`):
            # another machine's call goes there by way of a coordinator (`hand_on`).
            send(hand_on_message(run_id, turn, call.tool_use_id, headers=call.headers))
        else:
            send_tool_call(call)
    else:  # a coordinator tool: a coordinator runs it (`cmdop.local_tool`)
        # Its deadline as handed out now: a wait before it (a parked call) is not its own.
        args = (run_id, turn, call.tool_use_id)
        send(local_tool_message(*args, deadline_ms=call.deadline_ms, headers=call.headers))
    return None


def hand_on(rt: Runtime, run_id: str, turn: int, tool_use_id: str) -> None:
    """Send a sequential turn's call (or a fan-out's copy of the batch out), handed out
    by the machine that answered the call before it, to its own machine: if it is still
    out and never started. Its deadline is counted from now, as recovery's re-sending
    counts it."""
    out = rt.store.current_call(run_id, turn) == tool_use_id
    if not out and not rt.store.in_batch_out(run_id, turn, tool_use_id):
        return  # answered meanwhile (a cancel), or the turn was closed
    queued = rt.store.queued_call(run_id, turn, tool_use_id)
    if queued is None or queued.call is None or rt.store.was_started(run_id, tool_use_id):
        return
    send_tool_call(rt.store.hand_out_again(run_id, turn, queued))


def send_tool_call(call: QueuedCall) -> None:
    """Send a sequential turn's machine call to its queue, with its turn's trace context."""
    assert call.call is not None
    send(tool_message(call.call, call.headers))


def _capped(rt: Runtime, outcome: ToolOutcome) -> ToolOutcome:
    capped = cap_output(outcome.output, rt.settings.tool_output_max_bytes)
    return outcome if capped == outcome.output else outcome.model_copy(update={"output": capped})
