"""The fleet's Celery tasks, by name. Thin: each parses, then calls one function.

    cmdop.run   (cmdop.coordinator)       validate, store a run, enqueue turn 1; -> the run id
                                          (then drops the client's start entry: `state.starts`)
    cmdop.turn  (cmdop.coordinator)       advance a run by one turn  -> turn.execute_turn
    cmdop.tool  (cmdop.machine.<name>)    run one tool call on its machine -> machine.worker;
                                          REVOKED in Flower when cancelled or denied
    cmdop.local_tool (cmdop.coordinator)  run a coordinator tool whose turn has come in a
                                          sequential turn -> local_tools.run_queued
    cmdop.hand_on (cmdop.coordinator)     send a sequential turn's next call to its
                                          machine, for the machine that answered the one
                                          before it -> outcomes.hand_on

Each task first binds its log context (`logs.bind`): run id, turn, tool, machine; a
turn and a tool call run inside their trace span (`tracing`).
Other services start runs with `send_task("cmdop.run", kwargs={"request": ...})` and
need no import of this package.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import Ignore

from cmdop_worker import lifecycle, logs, messages, runtime, tracing
from cmdop_worker.celery_app import app
from cmdop_worker.coordinator.runs import run_id_for, start_run
from cmdop_worker.coordinator.turn import execute_turn
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import ToolCall
from cmdop_worker.state import starts


@app.task(name=messages.RUN_TASK, bind=True, throws=(InvalidRequest,))
def run(self: Any, request: Any) -> str:
    run_id = request.get("run_id") if isinstance(request, dict) else None
    logs.bind(run_id=run_id or run_id_for(self.request.id))
    rt = runtime.current()
    try:
        sent_ms = messages.sent_ms_of(self.request.headers)
        started = start_run(rt, request, fallback_id=self.request.id, sent_ms=sent_ms)
    except InvalidRequest:  # refused for good: sending it again would change nothing
        _start_handled(rt, run_id)
        raise
    _start_handled(rt, run_id)
    return started


@app.task(name=messages.TURN_TASK, ignore_result=True)
def turn(run_id: str, turn: int) -> None:
    logs.bind(run_id=run_id, turn=turn)
    with tracing.turn_span(run_id, turn):
        execute_turn(runtime.current(), run_id, turn)


@app.task(name=messages.TOOL_TASK, ignore_result=True)
def tool(call: dict[str, Any]) -> None:
    from cmdop_worker.machine.worker import execute_tool_call

    parsed = ToolCall.model_validate(call)
    logs.bind(run_id=parsed.run_id, turn=parsed.turn, tool=parsed.tool, machine=parsed.machine)
    with tracing.tool_span(parsed, tool.request.headers):  # the sender's `traceparent`
        status = execute_tool_call(lifecycle.machine_side(), parsed)
    if status in ("cancelled", "denied"):
        _end_revoked()


@app.task(name=messages.LOCAL_TOOL_TASK, ignore_result=True)
def local_tool(run_id: str, turn: int, tool_use_id: str, deadline_ms: int | None = None) -> None:
    from cmdop_worker.coordinator.local_tools import run_queued

    logs.bind(run_id=run_id, turn=turn)
    run_queued(runtime.current(), run_id, turn, tool_use_id, deadline_ms=deadline_ms)


@app.task(name=messages.HAND_ON_TASK, ignore_result=True)
def hand_on(run_id: str, turn: int, tool_use_id: str) -> None:
    from cmdop_worker.outcomes import hand_on as send_on

    logs.bind(run_id=run_id, turn=turn)
    send_on(runtime.current(), run_id, turn, tool_use_id)


def _start_handled(rt: runtime.Runtime, run_id: object) -> None:
    """The client's watchdog entry for this start (`state.starts`) is done with. Left in
    place when the task died or failed otherwise, so the start is sent again."""
    if isinstance(run_id, str):
        starts.handled(rt.redis, rt.keys, run_id)


def _end_revoked() -> None:
    """End a tool task whose call was cancelled or denied as REVOKED in Flower, not
    SUCCESS. Flower knows task states from worker events only (a tool task stores no
    result): send the event a revoked task gets, then `Ignore`, which sends none and
    acknowledges the message."""
    tool.send_event("task-revoked", terminated=False, signum=None, expired=False)
    raise Ignore()
