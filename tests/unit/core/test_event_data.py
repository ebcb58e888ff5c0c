"""`ToolStartData.of` names the call it starts: its id and tool from the call (a
machine's `ToolCall`, a coordinator tool's route, the outcome that answers it), the
machine and input as given."""

from __future__ import annotations

from cmdop_worker.core.event_data import ToolStartData
from cmdop_worker.core.routing import ToCoordinator
from cmdop_worker.models import ToolCall, ToolOutcome

CALL = ToolCall(
    run_id="r-1",
    turn=2,
    tool_use_id="t1",
    tool="bash",
    machine="m1",
    input={"command": "ls"},
    deadline_ms=10,
    run_deadline_ms=20,
)


def test_a_machine_calls_start_names_its_id_tool_machine_and_input() -> None:
    data = ToolStartData.of(CALL, machine="m1", input=CALL.input)
    assert data.wire() == {
        "tool_call_id": "t1",
        "tool": "bash",
        "machine": "m1",
        "input": {"command": "ls"},
    }


def test_a_coordinator_tools_start_has_no_machine() -> None:
    route = ToCoordinator("t2", "ask_machine", {"prompt": "hi", "machine": "m1"}, 10)
    data = ToolStartData.of(route, machine=None, input=route.input)
    assert (data.tool_call_id, data.tool, data.machine) == ("t2", "ask_machine", None)
    assert data.input == {"prompt": "hi", "machine": "m1"}


def test_an_outcomes_start_takes_the_input_it_is_given() -> None:
    outcome = ToolOutcome(tool_use_id="t3", tool="read_file", machine="m2", output="x")
    data = ToolStartData.of(outcome, machine=outcome.machine, input={"path": "/a"})
    assert data == ToolStartData(
        tool_call_id="t3", tool="read_file", machine="m2", input={"path": "/a"}
    )
