"""A `machines` call: its copies, its refusals, and its one result in the turn's results."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cmdop_worker.core.catalog import fleet_catalog
from cmdop_worker.core.fanout import copy_id
from cmdop_worker.core.results import Call, collected
from cmdop_worker.core.routing import (
    FanOut,
    Fleet,
    Refused,
    RoutingRules,
    ToMachine,
    reply_routes,
    route_call,
)
from cmdop_worker.core.tools import SPECS
from cmdop_worker.models import MachinePresence, ToolOutcome, ToolSpec, Usage

NOW = 1_000_000
RULES = RoutingRules(
    visible=frozenset({"execute_command", "read_file", "list_machines"}),
    known=frozenset({"execute_command", "read_file", "list_machines"}),
    coordinator_tools=frozenset({"list_machines"}),
    target_machine=None,
    default_timeout_ms=120_000,
    grace_ms=5_000,
    run_deadline_ms=NOW + 300_000,
    max_fanout=4,
)
LABELS = {
    "web-2": {"role": "web", "env": "prod"},
    "web-10": {"role": "web", "env": "prod"},
    "web-3": {"role": "web", "env": "staging"},
    "db-1": {"role": "db", "env": "prod"},
    "bare": {},
}
FLEET = Fleet(
    offered={
        "execute_command": frozenset(LABELS),
        "read_file": frozenset(LABELS) - {"web-3"},
    },
    online=frozenset(LABELS),
    labels=LABELS,
)


def call(name: str, tool_use_id: str = "toolu_1", **args: object) -> dict[str, object]:
    return {"id": tool_use_id, "name": name, "input": args}


def test_copies_one_per_matching_machine_in_name_order() -> None:
    route = route_call(
        call("execute_command", command="df", machines="role=web"), RULES, FLEET, NOW
    )
    assert isinstance(route, FanOut) and route.tool_use_id == "toolu_1"
    assert [c.machine for c in route.copies] == ["web-2", "web-3", "web-10"]
    for copy in route.copies:
        assert isinstance(copy, ToMachine)
        assert copy.tool_use_id == copy_id("toolu_1", copy.machine)
        assert copy.input == {"command": "df", "machine": copy.machine}


def test_a_machine_lacking_the_tool_is_a_refused_copy() -> None:
    route = route_call(call("read_file", path="/x", machines="role=web"), RULES, FLEET, NOW)
    assert isinstance(route, FanOut)
    refused = [c for c in route.copies if isinstance(c, Refused)]
    assert [(c.tool_use_id, c.machine) for c in refused] == [(copy_id("toolu_1", "web-3"), "web-3")]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        ({"machines": "role=web", "machine": "web-2"}, ["not both"]),
        ({"machines": "role in ("}, ["'machines': bad selector"]),
        ({"machines": 7}, ["'machines': bad selector"]),
        (
            {"machines": "role=cache"},
            ["no machine online matches the selector 'role=cache'", "env=prod (3)", "role=web (3)"],
        ),
        ({"machines": "*"}, ["matches 5 machines", "max_fanout (4)"]),
        ({}, ["needs a 'machine' argument", "'machines'"]),
    ],
)
def test_refused_whole(args: dict[str, object], fragments: list[str]) -> None:
    route = route_call(call("execute_command", command="df", **args), RULES, FLEET, NOW)
    assert isinstance(route, Refused) and route.tool_use_id == "toolu_1"
    assert route.status == "invalid"
    for fragment in fragments:
        assert fragment in route.message


def test_reply_routes_put_the_copies_in_the_calls_place() -> None:
    uses = [
        call("execute_command", "toolu_a", command="a", machine="bare"),
        call("execute_command", "toolu_b", command="b", machines="env=prod,role=web"),
        call("list_machines", "toolu_c"),
    ]
    routes, timeouts = reply_routes(
        uses, {}, RULES, FLEET, NOW, sent={}, cancelled=None, sequential=False
    )
    ids = [r.tool_use_id for r in routes]
    assert ids == ["toolu_a", "toolu_b@web-2", "toolu_b@web-10", "toolu_c"]
    assert set(timeouts) == set(ids)
    cancelled, _ = reply_routes(
        uses, {}, RULES, FLEET, NOW, sent={}, cancelled="operation", sequential=True
    )
    assert all(isinstance(r, Refused) and r.status == "cancelled" for r in cancelled)
    repaired, _ = reply_routes(
        uses, {"toolu_b": "bad json"}, RULES, FLEET, NOW, sent={}, cancelled=None, sequential=False
    )
    assert [r.tool_use_id for r in repaired if isinstance(r, Refused)] == [
        "toolu_b@web-2",
        "toolu_b@web-10",
    ]


def test_collected_merges_the_copies_of_a_call_into_one_result() -> None:
    calls = [
        Call("toolu_a", "execute_command", "bare"),
        Call("toolu_b@web-2", "execute_command", "web-2"),
        Call("toolu_b@web-10", "execute_command", "web-10"),
        Call("toolu_b@db-1", "execute_command", "db-1"),
    ]
    spent = Usage(input_tokens=2)

    def outcome(cid: str, machine: str, output: str, **more: object) -> ToolOutcome:
        return ToolOutcome(
            tool_use_id=cid, tool="execute_command", machine=machine, output=output, **more
        )

    stored = {
        "toolu_a": outcome("toolu_a", "bare", "one"),
        "toolu_b@web-2": outcome("toolu_b@web-2", "web-2", "exit_code: 0", usage=spent),
        "toolu_b@web-10": outcome("toolu_b@web-10", "web-10", "exit_code: 0", usage=spent),
    }
    message, usage = collected(calls, stored, Usage())
    assert isinstance(message.content, list)
    assert [b["tool_use_id"] for b in message.content] == ["toolu_a", "toolu_b"]
    assert message.content[1]["content"].splitlines() == [
        "execute_command on 3 machines: 2 ok, 1 lost",
        'web-2, web-10 (2): ok, exit 0: ""',
        'db-1 (1): lost: "no result was recorded for this call"',
    ]
    assert "is_error" not in message.content[1]
    assert usage == spent + spent


def test_two_fan_outs_side_by_side_stay_apart() -> None:
    calls = [Call("toolu_a@m1", "t", "m1"), Call("toolu_b@m1", "t", "m1")]
    stored = {
        c.tool_use_id: ToolOutcome(tool_use_id=c.tool_use_id, tool="t", output="x", status="error")
        for c in calls
    }
    message, _ = collected(calls, stored, Usage())
    assert isinstance(message.content, list)
    assert [(b["tool_use_id"], b.get("is_error")) for b in message.content] == [
        ("toolu_a", True),
        ("toolu_b", True),
    ]
    assert replace(RULES, max_fanout=1).max_fanout == 1


def test_the_catalogue_offers_machines_beside_machine_and_says_which_tool_is_for_what() -> None:
    spec = ToolSpec(
        name="execute_command",
        description="run",
        input_schema={"type": "object", "properties": {"command": {"type": "string"}}},
    )
    presences = [
        MachinePresence(machine=m, host="h", pid=1, started_ms=0, tools=[spec], labels=labels)
        for m, labels in LABELS.items()
    ]
    few = fleet_catalog(presences[:1], SPECS)
    many = fleet_catalog(presences, SPECS)
    assert few == many  # the block does not depend on the fleet
    schema = next(t for t in many if t.name == "execute_command").input_schema
    assert schema["properties"]["machines"]["type"] == "string"
    assert "ask_machines" in schema["properties"]["machines"]["description"]
    assert "machines" not in schema.get("required", [])
    ask = next(t for t in many if t.name == "ask_machines")
    assert "machines" in ask.description and "own reasoning" in ask.description
