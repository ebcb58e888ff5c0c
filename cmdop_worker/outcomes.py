"""A tool call's outcome, stored once through the turn barrier, by whoever answers it.

Both sides of a call write here: the machine worker that ran it, the coordinator for
a call it refused or ran itself, the watchdog and the liveness probe for a call whose
machine went quiet. `record` stores the outcome with its TOOL_END (and TOOL_START for a
call answered without starting) in one script; the writer whose outcome completes the
turn enqueues the next one (`enqueue_turn`), so a turn advances exactly once whichever
side finishes last.
"""

from __future__ import annotations

from typing import Any

from cmdop_worker.celery_app import app
from cmdop_worker.core.tools import cap_output
from cmdop_worker.models import ToolOutcome
from cmdop_worker.runtime import Runtime
from cmdop_worker.state.keys import COORDINATOR_QUEUE
from cmdop_worker.state.store import Recorded


def enqueue_turn(run_id: str, turn: int) -> None:
    app.send_task(
        "cmdop.turn",
        args=[run_id, turn],
        queue=COORDINATOR_QUEUE,
        task_id=f"{run_id}.turn.{turn}",
    )


def record(
    rt: Runtime,
    run_id: str,
    turn: int,
    outcome: ToolOutcome,
    *,
    tool_input: Any = None,
) -> Recorded:
    """Store an outcome once, with its TOOL_END (and a TOOL_START first, given the
    `tool_input` of a call answered without starting); the writer that completes the
    turn enqueues the next."""
    outcome = _capped(rt, outcome)
    events = [rt.events.frame(run_id, "TOOL_END", turn, end_data(rt, outcome))]
    if tool_input is not None:
        data = start_data(outcome.tool_use_id, outcome.tool, outcome.machine, tool_input)
        events.insert(0, rt.events.frame(run_id, "TOOL_START", turn, data))
    recorded = rt.store.record_outcome(run_id, turn, outcome, events)
    if recorded is Recorded.ADVANCE:
        enqueue_turn(run_id, turn + 1)
    return recorded


def _capped(rt: Runtime, outcome: ToolOutcome) -> ToolOutcome:
    capped = cap_output(outcome.output, rt.settings.tool_output_max_bytes)
    return outcome if capped == outcome.output else outcome.model_copy(update={"output": capped})


def start_data(tool_use_id: str, tool: str, machine: str | None, tool_input: Any) -> dict[str, Any]:
    """The data of a TOOL_START event, wherever the call starts."""
    return {"tool_call_id": tool_use_id, "tool": tool, "machine": machine, "input": tool_input}


def end_data(rt: Runtime, outcome: ToolOutcome) -> dict[str, Any]:
    limit = rt.settings.event_output_max_chars
    output = outcome.output
    if len(output) > limit:
        output = output[:limit] + f"… [{len(outcome.output) - limit} more characters]"
    return {
        "tool_call_id": outcome.tool_use_id,
        "tool": outcome.tool,
        "machine": outcome.machine,
        "is_error": outcome.is_error,
        "status": outcome.status,
        "output": output,
        "duration_ms": outcome.duration_ms,
    }
