"""Ending a run: the result record, the one terminal event, the parent's answer.

Called by the turn task (and by `start_run` never: a run that could not start was
never stored). The result is stored before the terminal event is emitted, so a client
that sees the event can read the result. A child run started by `ask_machine` hands
its answer to its parent's pending call.
"""

from __future__ import annotations

import logging
from typing import Any

from cmdop_worker.core.step import Finish
from cmdop_worker.models import (
    CancelChannel,
    CancelRequest,
    EventType,
    RunError,
    RunResult,
    StopReason,
)
from cmdop_worker.runtime import Runtime
from cmdop_worker.store import RunState

log = logging.getLogger(__name__)


def finish_done(rt: Runtime, state: RunState, step: Finish) -> None:
    result = _result(state, "done", step.stop_reason, text=step.text, output=step.output)
    data: dict[str, Any] = {
        "text": step.text,
        "usage": state.usage.model_dump(),
        "turns": state.turn,
        "stop_reason": step.stop_reason,
    }
    if state.request.output_schema is not None:
        data["output"] = step.output
    _end(rt, state, "done", result, "DONE", data)


def finish_error(rt: Runtime, state: RunState, kind: str, message: str) -> None:
    log.error("run %s failed: %s: %s", state.run_id, kind, message)
    result = _result(
        state, "error", "error", text=state.text, error=RunError(kind=kind, message=message)
    )
    _end(rt, state, "error", result, "ERROR", {"kind": kind, "message": message})


def finish_cancelled(
    rt: Runtime, state: RunState, channel: CancelChannel, reason: str, stop_reason: StopReason
) -> None:
    cancel = CancelRequest(channel=channel, reason=reason)
    result = _result(state, "cancelled", stop_reason, text=state.text, cancel=cancel)
    data = {
        "channel": channel,
        "reason": reason,
        "partial_text": state.text,
        "usage": state.usage.model_dump(),
    }
    _end(rt, state, "cancelled", result, "CANCELLED", data)


def _result(state: RunState, status: Any, stop_reason: StopReason, **fields: Any) -> RunResult:
    return RunResult(
        run_id=state.run_id,
        status=status,
        stop_reason=stop_reason,
        usage=state.usage,
        turns=state.turn,
        messages=state.history,
        metadata=state.request.metadata,
        **fields,
    )


def _end(
    rt: Runtime,
    state: RunState,
    status: Any,
    result: RunResult,
    event_type: EventType,
    data: dict[str, Any],
) -> None:
    final = state.model_copy(update={"status": status, "awaiting": []})
    rt.store.save(final)
    rt.store.store_result(result)
    rt.events.emit(state.run_id, event_type, state.turn, data)
    rt.store.unschedule(f"run:{state.run_id}", f"turn:{state.run_id}:{state.turn}")
    if state.parent is not None:
        from cmdop_worker.coordinator_tools import answer_parent

        answer_parent(rt, state.parent, result)
