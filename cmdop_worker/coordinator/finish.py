"""Ending a run: the result record, the one terminal event, the parent's answer.

Called by the turn task (and by `start_run` never: a run that could not start was
never stored). The result is stored before the terminal event is emitted, so a client
that sees the event can read the result. A child run started by `ask_machine` hands
its answer to its parent's pending call; a run on a thread hands the thread on
(`threads.hand_on`). The run's trace span is emitted here, once
the run has ended (`tracing.emit_run_span`).
"""

from __future__ import annotations

import logging
from typing import Any

from cmdop_worker import metrics, tracing
from cmdop_worker.coordinator.threads import hand_on
from cmdop_worker.core.event_data import CancelledData, DoneData, ErrorData
from cmdop_worker.core.step import Finish
from cmdop_worker.models import CancelChannel, CancelRequest, RunError, RunResult, StopReason
from cmdop_worker.runtime import Runtime
from cmdop_worker.state.keys import run_member, turn_member
from cmdop_worker.state.store import RunState

log = logging.getLogger(__name__)


def finish_done(rt: Runtime, state: RunState, step: Finish) -> None:
    _end(rt, state, result_of(state, "done", step.stop_reason, text=step.text, output=step.output))


def finish_error(rt: Runtime, state: RunState, kind: str, message: str) -> None:
    log.error("run %s failed: %s: %s", state.run_id, kind, message)
    error = RunError(kind=kind, message=message)
    _end(rt, state, result_of(state, "error", "error", text=state.text, error=error))


def finish_cancelled(
    rt: Runtime, state: RunState, channel: CancelChannel, reason: str, stop_reason: StopReason
) -> None:
    cancel = CancelRequest(channel=channel, reason=reason)
    _end(rt, state, result_of(state, "cancelled", stop_reason, text=state.text, cancel=cancel))


def result_of(state: RunState, status: Any, stop_reason: StopReason, **fields: Any) -> RunResult:
    return RunResult(
        run_id=state.run_id,
        status=status,
        stop_reason=stop_reason,
        usage=state.usage,
        turns=state.turn,
        messages=state.history,
        metadata=state.request.metadata,
        model=state.model_answered,
        **fields,
    )


def terminal_data(result: RunResult, *, has_schema: bool) -> DoneData | CancelledData | ErrorData:
    """The data of the terminal event that reports a result: DONE, CANCELLED or ERROR."""
    if result.status == "done":
        # `output` only for a request with an output_schema (then even when null).
        given = {"output": result.output} if has_schema else {}
        return DoneData(
            text=result.text,
            usage=result.usage,
            turns=result.turns,
            stop_reason=result.stop_reason,
            model=result.model,  # which model answered (a fallback's, after a switch)
            **given,
        )
    if result.status == "cancelled":
        cancel = result.cancel
        return CancelledData(
            channel=cancel.channel if cancel else "operation",
            reason=cancel.reason if cancel else "lost",
            partial_text=result.text,
            usage=result.usage,
        )
    error = result.error
    return ErrorData(
        kind=error.kind if error else "lost",
        message=error.message if error else "the run ended without a result",
    )


def _end(rt: Runtime, state: RunState, result: RunResult) -> None:
    data = terminal_data(result, has_schema=state.request.output_schema is not None)
    # State, result and terminal event in one step, fenced by the turn's lease (a holder
    # that lost it raises `LeaseLost` here, having ended nothing).
    ended = state.model_copy(update={"status": result.status, "awaiting": []})
    hand_on(rt, state)  # before the end is seen: a follow-up then finds the thread free
    rt.store.end_run(ended, result, rt.events.frame(state.run_id, state.turn, data))
    metrics.RUNS_ENDED.labels(status=result.status, stop_reason=result.stop_reason).inc()
    if result.cancel is not None:
        metrics.CANCELS.labels(channel=result.cancel.channel).inc()
    tracing.emit_run_span(state, result)
    rt.store.unschedule(run_member(state.run_id), turn_member(state.run_id, state.turn))
    from cmdop_worker.coordinator.local_tools import answer_parent, cancel_children

    # A child still working for this run (an ask whose call timed out) has no one to
    # answer any more.
    cancel_children(rt, state.run_id, CancelRequest(channel="ui", reason="parent run ended"))
    if state.parent is not None:
        answer_parent(rt, state.parent, result)
