"""The tool catalogue: which tools the model is offered on a turn, and in what shape.

Owns the fleet catalogue (machine-bound tools merged across the online machines, each
given a `machine` argument), the three per-turn filters of the agent loop (intent,
tool-category allowlist on turn 1, hide map last) and the conversion to Anthropic tool
definitions. Called by the coordinator (`coordinator/prepare.py`,
`coordinator/calls.py`) once per turn, with the presences it read from Redis and the
hide map from `Settings`.

Everything here is deterministic: the same presences give byte-identical definitions,
because the tool list sits at the very start of the prompt-cache prefix and any
reordering between turns would invalidate the whole cache.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from cmdop_worker.models import MachinePresence, ToolSpec

MACHINE_ARG = "machine"


def hidden_tools(
    hide_map: Mapping[str, frozenset[str]], platform: str | None, mode: str | None
) -> frozenset[str]:
    """Tool names hidden for this platform and mode: the union of every matching key.

    Keys consulted: `*`, `platform:<platform>`, `mode:<mode>` and `<platform>:<mode>`;
    a key whose part is None is not consulted.
    """
    keys = ["*"]
    if platform is not None:
        keys.append(f"platform:{platform}")
    if mode is not None:
        keys.append(f"mode:{mode}")
    if platform is not None and mode is not None:
        keys.append(f"{platform}:{mode}")
    hidden: frozenset[str] = frozenset()
    for key in keys:
        hidden |= hide_map.get(key, frozenset())
    return hidden


def fleet_catalog(
    presences: Sequence[MachinePresence],
    coordinator_tools: Sequence[ToolSpec],
    target_machine: str | None,
) -> list[ToolSpec]:
    """Every tool the fleet offers, sorted by name, machine-bound ones routed by `machine`.

    A machine-bound tool offered by several machines appears once; the spec of the
    machine whose name sorts first wins. Tools a machine advertises with
    `machine_bound=False` are ignored: only the coordinator runs those. On a name clash
    the coordinator's own tool wins, because the coordinator executes it locally.
    """
    specs: dict[str, ToolSpec] = {}
    machines: dict[str, set[str]] = {}
    for presence in sorted(presences, key=lambda p: p.machine):
        for spec in presence.tools:
            if not spec.machine_bound:
                continue
            specs.setdefault(spec.name, spec)
            machines.setdefault(spec.name, set()).add(presence.machine)
    merged = {
        name: _with_machine_arg(spec, sorted(machines[name]), target_machine)
        for name, spec in specs.items()
    }
    for tool in coordinator_tools:
        merged[tool.name] = tool
    return [merged[name] for name in sorted(merged)]


def _with_machine_arg(spec: ToolSpec, offered_by: list[str], target: str | None) -> ToolSpec:
    # A shallow copy: only its top level changes (`properties` and `required` are new);
    # `tool_definitions` copies the rest before a request holds it.
    schema = dict(spec.input_schema)
    schema.setdefault("type", "object")
    prop: dict[str, Any] = {"type": "string", "enum": offered_by}
    required = [name for name in schema.get("required", []) if name != MACHINE_ARG]
    if target is not None and target in offered_by:
        prop["default"] = target
        prop["description"] = f"Machine to run this tool on; defaults to {target}."
    else:
        prop["description"] = "Machine to run this tool on."
        required.append(MACHINE_ARG)
    schema["properties"] = {**schema.get("properties", {}), MACHINE_ARG: prop}
    if required:
        schema["required"] = required
    else:
        schema.pop("required", None)
    return spec.model_copy(update={"input_schema": schema})


def resolve_tools(
    catalog: Sequence[ToolSpec],
    *,
    turn: int,
    tool_tags: Sequence[str] | None,
    hidden: frozenset[str],
    direct: bool = False,
) -> list[ToolSpec]:
    """The tools offered this turn: intent, then the turn-1 allowlist, then the hide map.

    The hide map runs last so that nothing earlier can bring a hidden tool back; core
    tools survive the allowlist but not the hide map.
    """
    if direct:
        return []
    tools = list(catalog)
    if turn == 1 and tool_tags:
        allowed = frozenset(tool_tags)
        tools = [t for t in tools if t.core or allowed.intersection(t.tags)]
    return [t for t in tools if t.name not in hidden]


def tool_definitions(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Anthropic tool definitions; copies, so a caller may add cache markers freely."""
    return [
        {
            "name": tool.name,
            "description": tool.description,
            "input_schema": copy.deepcopy(tool.input_schema),
        }
        for tool in tools
    ]
