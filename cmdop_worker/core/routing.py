"""Where each tool call of a turn goes: a machine's queue, the coordinator, or nowhere.

Called by the coordinator's turn task after the model replied with tool calls. Pure:
the live fleet comes in as a `Fleet` value, the clock as `now_ms`.

A call is refused here, at once, as an error tool result the model can read, when the
tool is unknown or hidden, its arguments are not an object, its `machine` is missing or
malformed, or the machine is offline or does not offer the tool. Only well-addressed
calls reach a queue, so no call ever waits on a queue nobody consumes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cmdop_worker.models import MACHINE_PATTERN, ToolStatus

_MACHINE_RE = re.compile(MACHINE_PATTERN)
MIN_TIMEOUT_MS = 1
MAX_TIMEOUT_MS = 600_000


@dataclass(frozen=True)
class Fleet:
    """The live fleet as seen at the start of a turn."""

    offered: Mapping[str, frozenset[str]]  # machine-bound tool -> machines offering it
    online: frozenset[str]


@dataclass(frozen=True)
class Dispatch:
    tool_use_id: str
    tool: str
    machine: str
    input: dict[str, Any]
    deadline_ms: int


@dataclass(frozen=True)
class RunLocally:
    tool_use_id: str
    tool: str
    input: dict[str, Any]
    deadline_ms: int


@dataclass(frozen=True)
class Refuse:
    tool_use_id: str
    tool: str
    status: ToolStatus
    message: str
    machine: str | None = None


Route = Dispatch | RunLocally | Refuse


@dataclass(frozen=True)
class RoutingRules:
    """What the run may call and how long a call may take."""

    visible: frozenset[str]  # tools the run may call: the catalogue minus the hide map
    known: frozenset[str]  # every tool the fleet knows, to tell "hidden" from "unknown"
    coordinator_tools: frozenset[str]
    target_machine: str | None
    default_timeout_ms: int
    grace_ms: int
    run_deadline_ms: int
    # tool -> (argument holding its timeout in ms, default ms when absent)
    timeout_args: Mapping[str, tuple[str, int]] = field(default_factory=dict)


def clamp_timeout_ms(value: object, default_ms: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default_ms
    return int(min(max(value, MIN_TIMEOUT_MS), MAX_TIMEOUT_MS))


def call_deadline_ms(tool: str, args: Mapping[str, Any], rules: RoutingRules, now_ms: int) -> int:
    """When the watchdog gives up on a call: its own timeout plus grace, at most the
    run's deadline plus grace."""
    timeout_ms = rules.default_timeout_ms
    if tool in rules.timeout_args:
        arg, default_ms = rules.timeout_args[tool]
        timeout_ms = clamp_timeout_ms(args.get(arg), default_ms)
    return min(now_ms + timeout_ms, rules.run_deadline_ms) + rules.grace_ms


def route_call(
    tool_use: Mapping[str, Any], rules: RoutingRules, fleet: Fleet, now_ms: int
) -> Route:
    tool_use_id = str(tool_use["id"])
    tool = str(tool_use.get("name", ""))
    args = tool_use.get("input")
    if tool not in rules.visible:
        why = "is not available to this run" if tool in rules.known else "does not exist"
        return Refuse(tool_use_id, tool, "invalid", f"tool '{tool}' {why}")
    if not isinstance(args, dict):
        return Refuse(tool_use_id, tool, "invalid", f"arguments for {tool} must be a JSON object")
    deadline_ms = call_deadline_ms(tool, args, rules, now_ms)
    if tool in rules.coordinator_tools:
        return RunLocally(tool_use_id, tool, args, deadline_ms)
    return _route_to_machine(tool_use_id, tool, args, rules, fleet, deadline_ms)


def _route_to_machine(
    tool_use_id: str,
    tool: str,
    args: dict[str, Any],
    rules: RoutingRules,
    fleet: Fleet,
    deadline_ms: int,
) -> Route:
    machine = args.get("machine")
    if machine is None:  # absent or null: the run's target machine, when it has one
        machine = rules.target_machine
    if machine is None:
        return Refuse(tool_use_id, tool, "invalid", f"{tool} needs a 'machine' argument")
    if not isinstance(machine, str) or not _MACHINE_RE.match(machine):
        return Refuse(tool_use_id, tool, "invalid", f"'{machine}' is not a valid machine name")
    if machine not in fleet.online:
        return Refuse(tool_use_id, tool, "offline", f"machine {machine} is offline", machine)
    if machine not in fleet.offered.get(tool, frozenset()):
        return Refuse(
            tool_use_id, tool, "invalid", f"machine {machine} does not offer {tool}", machine
        )
    return Dispatch(tool_use_id, tool, machine, {**args, "machine": machine}, deadline_ms)


def route_calls(
    tool_uses: Sequence[Mapping[str, Any]], rules: RoutingRules, fleet: Fleet, now_ms: int
) -> list[Route]:
    return [route_call(tool_use, rules, fleet, now_ms) for tool_use in tool_uses]


def own_timeout_ms(route: Route, rules: RoutingRules, now_ms: int) -> int:
    """The time a call routed at `now_ms` may take once it starts (0: a refused call).
    A sequential turn stores it with each call, whose deadline is set when it is sent."""
    if isinstance(route, Refuse):
        return 0
    return route.deadline_ms - rules.grace_ms - now_ms


def sequential_deadlines(routes: Sequence[Route], rules: RoutingRules, now_ms: int) -> list[Route]:
    """Calls run one after another: each may take its own timeout after the ones before
    it, so the watchdog's deadline of call i, as planned, is the sum of the timeouts up
    to i (each call's own deadline is set again when it is sent: `own_timeout_ms`)."""
    elapsed_ms = 0
    shifted: list[Route] = []
    for route in routes:
        if isinstance(route, Refuse):
            shifted.append(route)
            continue
        elapsed_ms += own_timeout_ms(route, rules, now_ms)
        deadline = min(now_ms + elapsed_ms, rules.run_deadline_ms) + rules.grace_ms
        shifted.append(replace(route, deadline_ms=deadline))
    return shifted
