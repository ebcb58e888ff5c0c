"""Routing a turn's calls: where each goes, and why a call is refused at once."""

from __future__ import annotations

import pytest

from cmdop_worker.core.routing import (
    Dispatch,
    Fleet,
    Refuse,
    RoutingRules,
    RunLocally,
    clamp_timeout_ms,
    route_call,
    sequential_deadlines,
)

NOW = 1_000_000
RULES = RoutingRules(
    visible=frozenset({"execute_command", "read_file", "list_machines"}),
    known=frozenset({"execute_command", "read_file", "write_file", "list_machines"}),
    coordinator_tools=frozenset({"list_machines"}),
    target_machine=None,
    default_timeout_ms=120_000,
    grace_ms=5_000,
    run_deadline_ms=NOW + 300_000,
    timeout_args={"execute_command": ("timeout_ms", 120_000)},
)
FLEET = Fleet(
    offered={"execute_command": frozenset({"alpha", "beta"}), "read_file": frozenset({"alpha"})},
    online=frozenset({"alpha", "beta"}),
)


def call(name: str, **args: object) -> dict[str, object]:
    return {"id": "toolu_1", "name": name, "input": args}


@pytest.mark.parametrize(
    ("tool_use", "status", "fragment"),
    [
        (call("rm_everything"), "invalid", "'rm_everything' does not exist"),
        (call("write_file", machine="alpha"), "invalid", "not available to this run"),
        ({"id": "toolu_1", "name": "read_file", "input": "oops"}, "invalid", "JSON object"),
        (call("read_file", path="/x"), "invalid", "needs a 'machine'"),
        (call("read_file", machine="Bad Host", path="/x"), "invalid", "not a valid machine"),
        (call("read_file", machine="gamma", path="/x"), "offline", "machine gamma is offline"),
        (call("read_file", machine="beta", path="/x"), "invalid", "beta does not offer read_file"),
    ],
)
def test_refusals_name_the_problem(tool_use, status, fragment) -> None:
    route = route_call(tool_use, RULES, FLEET, NOW)
    assert isinstance(route, Refuse)
    assert route.status == status and fragment in route.message


def test_a_well_addressed_call_goes_to_its_machine_with_a_deadline() -> None:
    route = route_call(
        call("execute_command", machine="beta", command="ls", timeout_ms=10_000), RULES, FLEET, NOW
    )
    assert isinstance(route, Dispatch)
    assert route.machine == "beta" and route.deadline_ms == NOW + 10_000 + 5_000


def test_the_target_machine_is_the_default() -> None:
    rules = RoutingRules(**{**RULES.__dict__, "target_machine": "alpha"})
    route = route_call(call("read_file", path="/x"), rules, FLEET, NOW)
    assert (
        isinstance(route, Dispatch)
        and route.machine == "alpha"
        and route.input["machine"] == "alpha"
    )


def test_coordinator_tools_run_locally() -> None:
    assert isinstance(route_call(call("list_machines"), RULES, FLEET, NOW), RunLocally)


def test_deadlines_are_capped_by_the_run_deadline() -> None:
    rules = RoutingRules(**{**RULES.__dict__, "run_deadline_ms": NOW + 1_000})
    route = route_call(call("execute_command", machine="alpha", command="x"), rules, FLEET, NOW)
    assert isinstance(route, Dispatch) and route.deadline_ms == NOW + 1_000 + 5_000


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 7), (0, 1), (-5, 1), (10**9, 600_000), (True, 7), ("9", 7), (2.5, 2)],
)
def test_timeouts_are_clamped(value, expected) -> None:
    assert clamp_timeout_ms(value, 7) == expected


def test_sequential_calls_get_cumulative_deadlines() -> None:
    calls = [
        {
            "id": f"t{i}",
            "name": "execute_command",
            "input": {"machine": "alpha", "command": "x", "timeout_ms": 10_000},
        }
        for i in range(3)
    ]
    routes = [route_call(c, RULES, FLEET, NOW) for c in calls]
    shifted = sequential_deadlines(routes, RULES, NOW)
    assert [r.deadline_ms for r in shifted] == [NOW + 10_000 * k + 5_000 for k in (1, 2, 3)]
