"""The tool catalogue: which tools the model is offered on a turn, and in what shape.

Owns the fleet catalogue (machine-bound tools merged across the online machines, each
given a `machine` argument and, for one call on many machines, `machines`: a selector,
`core.fanout`), the three per-turn filters of the agent loop (intent,
tool-category allowlist on turn 1, hide map last) and the conversion to Anthropic tool
definitions. Called by the coordinator (`coordinator/calls.py`) when the fleet it reads
has changed, with the presences it read from Redis, and per turn (`coordinator/prepare.py`)
with the hide map from `Settings`.

The tool list sits at the very start of the prompt-cache prefix, so it depends on the
set of tool definitions the fleet offers and on nothing else: not on which machines
offer them, how many there are, their order, or the run's target machine. `machine`
is a plain string (routing checks it: `core.routing`), never an enum of the machines
online, which grew the block by ~80 bytes a machine and broke every running run's
cache whenever a machine joined or left. A tool stays in while any machine offers it;
several machines offering different specs under one name give the one whose canonical
JSON sorts first, so a machine leaving changes the block only when it took the last
copy of a spec with it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from cmdop_worker.models import MachinePresence, ToolSpec

MACHINE_ARG = "machine"
MACHINES_ARG = "machines"


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


MACHINE_PROPERTY: dict[str, Any] = {
    "type": "string",
    "description": (
        "Name of the machine to run this tool on (list_machines lists the machines online). "
        "It may be left out when the run has a target machine: the tool runs there. "
        "Give machine or machines, not both."
    ),
}

MACHINES_PROPERTY: dict[str, Any] = {
    "type": "string",
    "description": (
        "Instead of machine: a label selector (role=web,env!=staging; region in (eu,us); "
        "!canary; * for every machine). The same call runs on every matching machine "
        "online, and one result groups the machines by outcome. For the same command "
        "everywhere; when each machine needs its own reasoning, use ask_machines."
    ),
}


def fleet_catalog(
    presences: Sequence[MachinePresence], coordinator_tools: Sequence[ToolSpec]
) -> list[ToolSpec]:
    """Every tool the fleet offers, sorted by name, machine-bound ones routed by `machine`.

    A machine-bound tool offered by several machines appears once (the module
    docstring says which spec). Tools a machine advertises with `machine_bound=False`
    are ignored: only the coordinator runs those. On a name clash the coordinator's own
    tool wins, because the coordinator executes it locally.
    """
    # Told apart by equality (the same parsed object, mostly: unchanged presences are
    # parsed once), not by their JSON: one dump per tool per machine was the whole cost
    # of a reload at 10,000 machines. Only the few distinct variants are dumped, to pick.
    variants: dict[str, list[ToolSpec]] = {}
    for presence in presences:
        for spec in presence.tools:
            if not spec.machine_bound:
                continue
            seen = variants.setdefault(spec.name, [])
            if not any(spec is known or spec == known for known in seen):
                seen.append(spec)
    merged = {
        name: _with_machine_arg(min(specs, key=_canonical)) for name, specs in variants.items()
    }
    for tool in coordinator_tools:
        merged[tool.name] = tool
    return [merged[name] for name in sorted(merged)]


def _canonical(spec: ToolSpec) -> str:
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def _with_machine_arg(spec: ToolSpec) -> ToolSpec:
    # A shallow copy: only its top level changes (`properties` and `required` are new);
    # `tool_definitions` copies the rest before a request holds it. `machine` is never
    # required: a run with a target machine may leave it out (routing says when a call
    # needs one).
    schema = dict(spec.input_schema)
    schema.setdefault("type", "object")
    properties = {
        **schema.get("properties", {}),
        MACHINE_ARG: dict(MACHINE_PROPERTY),
        MACHINES_ARG: dict(MACHINES_PROPERTY),
    }
    schema["properties"] = properties
    required = [n for n in schema.get("required", []) if n not in (MACHINE_ARG, MACHINES_ARG)]
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
