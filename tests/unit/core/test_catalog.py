"""Tool catalogue: fleet merge, the three filters in order, Anthropic definitions."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cmdop_worker.core.catalog import (
    MACHINE_PROPERTY,
    fleet_catalog,
    hidden_tools,
    resolve_tools,
    tool_definitions,
)
from cmdop_worker.models import MachinePresence, ToolSpec

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"path": {"type": "string"}},
    "required": ["path"],
}


def spec(name: str, *, tags: tuple[str, ...] = (), core: bool = False, **kw: Any) -> ToolSpec:
    return ToolSpec(
        name=name,
        description=kw.pop("description", f"{name} tool"),
        input_schema=kw.pop("input_schema", SCHEMA),
        tags=tags,
        core=core,
        **kw,
    )


def presence(machine: str, *tools: ToolSpec) -> MachinePresence:
    return MachinePresence(machine=machine, host=machine, pid=1, started_ms=0, tools=list(tools))


ASK = spec("ask_machine", machine_bound=False, core=True)

HIDE = {
    "*": frozenset({"everywhere"}),
    "platform:mobile": frozenset({"shell"}),
    "mode:readonly": frozenset({"write_file"}),
    "mobile:readonly": frozenset({"read_file"}),
    "platform:browser": frozenset({"screenshot"}),
}


@pytest.mark.parametrize(
    ("platform", "mode", "expected"),
    [
        (None, None, {"everywhere"}),
        ("mobile", None, {"everywhere", "shell"}),
        (None, "readonly", {"everywhere", "write_file"}),
        ("mobile", "readonly", {"everywhere", "shell", "write_file", "read_file"}),
        ("browser", "readonly", {"everywhere", "screenshot", "write_file"}),
        ("vps", "chat", {"everywhere"}),
    ],
)
def test_hidden_tools(platform: str | None, mode: str | None, expected: set[str]) -> None:
    assert hidden_tools(HIDE, platform, mode) == frozenset(expected)


def test_hidden_tools_empty_map() -> None:
    assert hidden_tools({}, "mobile", "readonly") == frozenset()


def test_fleet_catalog_merges_by_name_and_adds_a_plain_machine_string() -> None:
    catalog = fleet_catalog(
        [presence("vps-b", spec("read_file")), presence("vps-a", spec("read_file"), spec("shell"))],
        [ASK],
    )
    assert [t.name for t in catalog] == ["ask_machine", "read_file", "shell"]
    read = catalog[1]
    assert read.description == "read_file tool"
    machine = read.input_schema["properties"]["machine"]
    assert machine == MACHINE_PROPERTY and "list_machines" in machine["description"]
    assert "enum" not in machine and "default" not in machine
    assert read.input_schema["required"] == ["path"]  # a target machine may stand in
    assert catalog[2].input_schema["properties"]["machine"] == MACHINE_PROPERTY
    assert catalog[0] == ASK


def test_fleet_catalog_of_a_tool_offered_differently_takes_the_first_spec_by_content() -> None:
    first, second = spec("read_file", description="a"), spec("read_file", description="b")
    for presences in (
        [presence("vps-a", second), presence("vps-b", first)],
        [presence("vps-a", first), presence("vps-b", second)],
    ):
        (tool,) = fleet_catalog(presences, [])
        assert tool.description == "a"


def test_fleet_catalog_optional_machine_without_other_required() -> None:
    bare = spec("uptime", input_schema={"type": "object", "properties": {}})
    (tool,) = fleet_catalog([presence("m1", bare)], [])
    assert "required" not in tool.input_schema


def test_fleet_catalog_ignores_machine_tools_not_bound_and_coordinator_wins() -> None:
    local = spec("notes", machine_bound=False)
    clash = spec("ask_machine", description="impostor")
    catalog = fleet_catalog([presence("m1", local, clash)], [ASK])
    assert catalog == [ASK]


def test_fleet_catalog_does_not_mutate_specs() -> None:
    original = spec("shell")
    fleet_catalog([presence("m1", original)], [])
    assert original.input_schema == SCHEMA
    assert "machine" not in SCHEMA["properties"]


def dump(presences: list[MachinePresence]) -> str:
    return json.dumps(tool_definitions(fleet_catalog(presences, [ASK])))


def test_fleet_catalog_is_byte_stable_whatever_the_presence_order() -> None:
    a = presence("a", spec("shell"), spec("read_file"))
    b = presence("b", spec("read_file", description="b's"), spec("df"))
    assert dump([a, b]) == dump([b, a])


def test_fleet_catalog_is_the_same_bytes_whichever_machines_offer_the_tools() -> None:
    tools = (spec("shell"), spec("read_file"))
    two = [presence("a", *tools), presence("b", *tools)]
    thousand = [presence(f"web-{i:04d}", *tools) for i in range(1000)]
    others = [presence("z", *tools), presence("a", *tools), presence("new-one", *tools)]
    assert dump(two) == dump(thousand) == dump(others)


def test_fleet_catalog_keeps_a_tool_while_any_machine_offers_it() -> None:
    a = presence("a", spec("shell"))
    b = presence("b", spec("shell"), spec("gpu"))
    assert [t.name for t in fleet_catalog([a, b], [])] == ["gpu", "shell"]
    assert [t.name for t in fleet_catalog([a], [])] == ["shell"]


CATALOG = [
    spec("ask_machine", machine_bound=False, core=True),
    spec("read_file", tags=("fs",)),
    spec("shell", tags=("exec", "fs")),
    spec("browse", tags=("web",)),
    spec("help", core=True),
]


@pytest.mark.parametrize(
    ("turn", "tags", "hidden", "direct", "expected"),
    [
        (1, None, frozenset(), False, ["ask_machine", "read_file", "shell", "browse", "help"]),
        (1, [], frozenset(), False, ["ask_machine", "read_file", "shell", "browse", "help"]),
        (1, ["fs"], frozenset(), False, ["ask_machine", "read_file", "shell", "help"]),
        (1, ["web", "exec"], frozenset(), False, ["ask_machine", "shell", "browse", "help"]),
        (2, ["fs"], frozenset(), False, ["ask_machine", "read_file", "shell", "browse", "help"]),
        (1, ["fs"], frozenset({"help", "shell"}), False, ["ask_machine", "read_file"]),
        (3, None, frozenset({"browse"}), False, ["ask_machine", "read_file", "shell", "help"]),
        (1, None, frozenset(), True, []),
        (5, ["fs"], frozenset(), True, []),
    ],
)
def test_resolve_tools(
    turn: int,
    tags: list[str] | None,
    hidden: frozenset[str],
    direct: bool,
    expected: list[str],
) -> None:
    tools = resolve_tools(CATALOG, turn=turn, tool_tags=tags, hidden=hidden, direct=direct)
    assert [t.name for t in tools] == expected


def test_tool_definitions_shape_and_copies() -> None:
    (definition,) = tool_definitions([spec("shell", tags=("x",))])
    assert definition == {"name": "shell", "description": "shell tool", "input_schema": SCHEMA}
    definition["input_schema"]["properties"]["evil"] = {}
    assert "evil" not in SCHEMA["properties"]
