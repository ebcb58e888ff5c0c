"""Routing a turn's calls: where each goes, and why a call is refused at once."""

from __future__ import annotations

import pytest

from cmdop_worker.core.routing import (
    CLOSEST_AT_MOST,
    Fleet,
    Refused,
    RoutingRules,
    ToCoordinator,
    ToMachine,
    clamp_timeout_ms,
    fleet_of,
    offered_by,
    reply_routes,
    route_call,
    sequential_deadlines,
)
from cmdop_worker.models import MachinePresence, ToolSpec

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


def spec(name: str) -> ToolSpec:
    return ToolSpec(name=name, description=name, input_schema={"type": "object"})


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
        (call("read_file", machine="beta", path="/x"), "invalid", "offered by alpha"),
        (call("read_file", machine="alpah", path="/x"), "offline", "closest online names: alpha"),
        (call("read_file", machine="zzzz", path="/x"), "offline", "list_machines lists"),
    ],
)
def test_refusals_name_the_problem(tool_use, status, fragment) -> None:
    route = route_call(tool_use, RULES, FLEET, NOW)
    assert isinstance(route, Refused)
    assert route.status == status and fragment in route.message


def test_an_offline_machine_in_an_empty_fleet_is_said_so() -> None:
    empty = Fleet(offered={}, online=frozenset())
    route = route_call(call("read_file", machine="alpha", path="/x"), RULES, empty, NOW)
    assert isinstance(route, Refused) and route.status == "offline"
    assert route.message == "machine alpha is offline; no machine is online"


def test_the_closest_names_are_a_few_of_many() -> None:
    online = frozenset({f"web-{i:04d}" for i in range(1000)} | {"db-1"})
    fleet = Fleet(offered={"read_file": online}, online=online)
    route = route_call(call("read_file", machine="web-10000", path="/x"), RULES, fleet, NOW)
    assert isinstance(route, Refused) and route.status == "offline"
    closest = route.message.split("closest online names: ")[1].split(", ")
    assert 1 <= len(closest) <= CLOSEST_AT_MOST and all(n.startswith("web-") for n in closest)


@pytest.mark.parametrize(
    ("offering", "expected"),
    [
        (set(), "no machine online offers it"),
        ({"b", "a"}, "offered by a, b"),
        (
            {f"m{i:02d}" for i in range(10)},
            "offered by " + ", ".join(f"m{i:02d}" for i in range(10)),
        ),
        (
            {f"m{i:02d}" for i in range(47)},
            "offered by " + ", ".join(f"m{i:02d}" for i in range(10)) + " and 37 more",
        ),
    ],
)
def test_offered_by_names_at_most_ten_machines(offering: set[str], expected: str) -> None:
    assert offered_by(offering) == expected


def test_a_well_addressed_call_goes_to_its_machine_with_a_deadline() -> None:
    route = route_call(
        call("execute_command", machine="beta", command="ls", timeout_ms=10_000), RULES, FLEET, NOW
    )
    assert isinstance(route, ToMachine)
    assert route.machine == "beta" and route.deadline_ms == NOW + 10_000 + 5_000


def test_the_target_machine_is_the_default() -> None:
    rules = RoutingRules(**{**RULES.__dict__, "target_machine": "alpha"})
    route = route_call(call("read_file", path="/x"), rules, FLEET, NOW)
    assert (
        isinstance(route, ToMachine)
        and route.machine == "alpha"
        and route.input["machine"] == "alpha"
    )


def test_coordinator_tools_run_locally() -> None:
    assert isinstance(route_call(call("list_machines"), RULES, FLEET, NOW), ToCoordinator)


def test_deadlines_are_capped_by_the_run_deadline() -> None:
    rules = RoutingRules(**{**RULES.__dict__, "run_deadline_ms": NOW + 1_000})
    route = route_call(call("execute_command", machine="alpha", command="x"), rules, FLEET, NOW)
    assert isinstance(route, ToMachine) and route.deadline_ms == NOW + 1_000 + 5_000


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


def test_the_fleet_is_who_is_online_and_who_offers_what() -> None:
    presences = [
        MachinePresence(
            machine="alpha", host="a", pid=1, started_ms=0, tools=[spec("read_file"), spec("grep")]
        ),
        MachinePresence(machine="beta", host="b", pid=2, started_ms=0, tools=[spec("read_file")]),
    ]
    fleet = fleet_of(presences)
    assert fleet.online == {"alpha", "beta"}
    assert fleet.offered == {"read_file": {"alpha", "beta"}, "grep": {"alpha"}}
    assert fleet_of([]) == Fleet(offered={}, online=frozenset())


def reply(*ids: str) -> list[dict[str, object]]:
    return [
        {"id": i, "name": "execute_command", "input": {"machine": "alpha", "command": "ls"}}
        for i in ids
    ]


def test_a_reply_keeps_its_calls_sent_early_and_refuses_repaired_ones() -> None:
    early = ToMachine("a", "execute_command", "alpha", {"machine": "alpha"}, NOW + 1)
    routes, timeouts = reply_routes(
        reply("a", "b", "c"),
        {"c": "the call had no usable id; it was not run"},
        RULES,
        FLEET,
        NOW,
        sent={"a": early},
        cancelled=None,
        sequential=False,
    )
    assert routes[0] is early  # as it was sent, not routed again
    assert isinstance(routes[1], ToMachine)
    assert routes[2] == Refused(
        "c", "execute_command", "invalid", "the call had no usable id; it was not run"
    )
    assert timeouts["b"] == 120_000


def test_an_operation_cancel_refuses_every_call_not_sent_early() -> None:
    early = ToMachine("a", "execute_command", "alpha", {"machine": "alpha"}, NOW + 1)
    routes, _ = reply_routes(
        reply("a", "b"),
        {},
        RULES,
        FLEET,
        NOW,
        sent={"a": early},
        cancelled="user",
        sequential=False,
    )
    assert routes[0] is early
    assert routes[1] == Refused(
        "b", "execute_command", "cancelled", "cancelled (user) before it started"
    )


def test_a_sequential_reply_plans_each_deadline_after_the_calls_before_it() -> None:
    routes, timeouts = reply_routes(
        reply("a", "b"), {}, RULES, FLEET, NOW, sent={}, cancelled=None, sequential=True
    )
    first, second = routes
    assert isinstance(first, ToMachine) and isinstance(second, ToMachine)
    assert first.deadline_ms == NOW + 120_000 + 5_000
    assert second.deadline_ms == NOW + 240_000 + 5_000
    assert timeouts == {"a": 120_000, "b": 120_000}  # each its own, counted when sent


def test_a_coordinator_tool_runs_on_no_machine() -> None:
    route = route_call(call("list_machines"), RULES, FLEET, NOW)
    assert isinstance(route, ToCoordinator) and route.machine is None
