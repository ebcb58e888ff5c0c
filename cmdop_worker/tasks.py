"""The fleet's Celery tasks, by name. Thin: each parses, then calls one function.

    cmdop.run   (cmdop.coordinator)       validate, store a run, enqueue turn 1; -> the run id
    cmdop.turn  (cmdop.coordinator)       advance a run by one turn  -> turn.execute_turn
    cmdop.tool  (cmdop.machine.<name>)    run one tool call on its machine -> machine.worker

Each task first binds its log context (`logs.bind`): run id, turn, tool, machine.
Other services start runs with `send_task("cmdop.run", kwargs={"request": ...})` and
need no import of this package.
"""

from __future__ import annotations

from typing import Any

from cmdop_worker import lifecycle, logs, runtime
from cmdop_worker.celery_app import app
from cmdop_worker.coordinator.runs import start_run
from cmdop_worker.coordinator.turn import execute_turn
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import ToolCall


@app.task(name="cmdop.run", bind=True, throws=(InvalidRequest,))
def run(self: Any, request: Any) -> str:
    run_id = request.get("run_id") if isinstance(request, dict) else None
    logs.bind(run_id=run_id or self.request.id)
    return start_run(runtime.current(), request, fallback_id=self.request.id)


@app.task(name="cmdop.turn", ignore_result=True)
def turn(run_id: str, turn: int) -> None:
    logs.bind(run_id=run_id, turn=turn)
    execute_turn(runtime.current(), run_id, turn)


@app.task(name="cmdop.tool", ignore_result=True)
def tool(call: dict[str, Any]) -> None:
    from cmdop_worker.machine.worker import execute_tool_call

    parsed = ToolCall.model_validate(call)
    logs.bind(run_id=parsed.run_id, turn=parsed.turn, tool=parsed.tool, machine=parsed.machine)
    execute_tool_call(lifecycle.machine_side(), parsed)
