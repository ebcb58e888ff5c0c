"""Where each tool call of a turn goes: a machine's queue, the coordinator, or nowhere.

Called by `coordinator.calls` after the model replied with tool calls (and by
`coordinator.eager` for each call as it streams in). Pure: the live fleet comes in as a
`Fleet` value (`fleet_of` the presences the turn read once), the clock as `now_ms`.

A call goes `ToMachine` (a machine's queue), `ToCoordinator` (a tool the coordinator
runs itself) or is `Refused`.

A call is refused here, at once, as an error tool result the model can read, when the
tool is unknown or hidden, its arguments are not an object, its `machine` is missing or
malformed, or the machine is offline or does not offer the tool. Only well-addressed
calls reach a queue, so no call ever waits on a queue nobody consumes.

The catalogue does not list the machines (`core.catalog`): `machine` is any string, and
this is where a name is checked. A call may instead give `machines`, a label selector
(`core.selectors`): it routes as a `FanOut`, one copy per matching machine online
(`core.fanout`), each copy a `ToMachine` (or, its machine lacking the tool, a `Refused`)
under its own id; `reply_routes` puts the copies in the call's place. A bad selector,
one matching no machine online (the refusal names the label groups there are) or more
than the run's `max_fanout`, or both `machine` and `machines`, is refused whole.

A refusal says what to do instead: for a name the fleet never saw ("unknown machine",
not "offline": `core.machine_names`) the closest known names; for an offline one the
closest online names; or the machines that offer a tool the named one lacks (at most
`NAMED_AT_MOST`, then how many more).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cmdop_worker.core.fanout import (
    DEFAULT_MAX_FANOUT,
    MACHINES_ARG,
    copy_id,
    copy_input,
    label_groups,
    name_key,
    parent_id,
)
from cmdop_worker.core.machine_names import unknown_machine
from cmdop_worker.core.selectors import SelectorError, parse_selector
from cmdop_worker.models import MACHINE_PATTERN, MachinePresence, ToolStatus

_MACHINE_RE = re.compile(MACHINE_PATTERN)
MIN_TIMEOUT_MS = 1
MAX_TIMEOUT_MS = 600_000
NAMED_AT_MOST = 10  # machines a refusal names; the rest are counted
CLOSEST_AT_MOST = 3


@dataclass(frozen=True)
class Fleet:
    """The live fleet as seen at the start of a turn."""

    offered: Mapping[str, frozenset[str]]  # machine-bound tool -> machines offering it
    online: frozenset[str]
    labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # machine -> labels
    # Every name the fleet has seen, online or not (`state.seen`); None: not read, and
    # every name not online is taken for a known one (answered "offline").
    known: frozenset[str] | None = None


def fleet_of(presences: Sequence[MachinePresence], known: Collection[str] | None = None) -> Fleet:
    """The fleet as the presences read for a turn show it: who is online, who offers what."""
    offered: dict[str, set[str]] = {}
    for presence in presences:
        for spec in presence.tools:
            offered.setdefault(spec.name, set()).add(presence.machine)
    return Fleet(
        offered={tool: frozenset(ms) for tool, ms in offered.items()},
        online=frozenset(p.machine for p in presences),
        labels={p.machine: p.labels for p in presences},
        known=None if known is None else frozenset(known) | {p.machine for p in presences},
    )


@dataclass(frozen=True)
class ToMachine:
    """A call sent to `machine`'s queue."""

    tool_use_id: str
    tool: str
    machine: str
    input: dict[str, Any]
    deadline_ms: int


@dataclass(frozen=True)
class ToCoordinator:
    """A call the coordinator runs itself (`core.tools.NAMES`)."""

    tool_use_id: str
    tool: str
    input: dict[str, Any]
    deadline_ms: int

    @property
    def machine(self) -> None:
        """It runs on no machine."""
        return None


@dataclass(frozen=True)
class Refused:
    """A call answered at once with an error the model can read; never run."""

    tool_use_id: str
    tool: str
    status: ToolStatus
    message: str
    machine: str | None = None


Route = ToMachine | ToCoordinator | Refused


@dataclass(frozen=True)
class FanOut:
    """A call given `machines`: one copy per matching machine online, in name order."""

    tool_use_id: str
    tool: str
    copies: tuple[ToMachine | Refused, ...]

    @property
    def machine(self) -> None:
        """It runs on many machines, each copy on its own."""
        return None


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
    max_fanout: int = DEFAULT_MAX_FANOUT  # machines one `machines` call may reach
    copy_key: str = ""  # the run's key of its fan-out copies' ids (`fanout.copy_id`)


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
) -> Route | FanOut:
    tool_use_id = str(tool_use["id"])
    tool = str(tool_use.get("name", ""))
    args = tool_use.get("input")
    if tool not in rules.visible:
        why = "is not available to this run" if tool in rules.known else "does not exist"
        return Refused(tool_use_id, tool, "invalid", f"tool '{tool}' {why}")
    if not isinstance(args, dict):
        return Refused(tool_use_id, tool, "invalid", f"arguments for {tool} must be a JSON object")
    deadline_ms = call_deadline_ms(tool, args, rules, now_ms)
    if tool in rules.coordinator_tools:
        return ToCoordinator(tool_use_id, tool, args, deadline_ms)
    return _route_to_machine(tool_use_id, tool, args, rules, fleet, deadline_ms)


def _route_to_machine(
    tool_use_id: str,
    tool: str,
    args: dict[str, Any],
    rules: RoutingRules,
    fleet: Fleet,
    deadline_ms: int,
) -> Route | FanOut:
    if args.get(MACHINES_ARG) is not None:
        return _fan_out(tool_use_id, tool, args, rules, fleet, deadline_ms)
    machine = args.get("machine")
    if machine is None:  # absent or null: the run's target machine, when it has one
        machine = rules.target_machine
    if machine is None:
        why = (
            f"{tool} needs a 'machine' argument (one name) or 'machines' (a label selector "
            "such as role=web, or * for every machine); list_machines lists the machines online"
        )
        return Refused(tool_use_id, tool, "invalid", why)
    if not isinstance(machine, str) or not _MACHINE_RE.match(machine):
        return Refused(tool_use_id, tool, "invalid", f"'{machine}' is not a valid machine name")
    if fleet.known is not None and machine not in fleet.known:  # never seen: a typo?
        why = unknown_machine(machine, fleet.known, fleet.online)
        return Refused(tool_use_id, tool, "invalid", why, machine)
    if machine not in fleet.online:
        return Refused(tool_use_id, tool, "offline", offline_message(machine, fleet), machine)
    offering = fleet.offered.get(tool, frozenset())
    if machine not in offering:
        why = f"machine {machine} does not offer {tool}; {offered_by(offering)}"
        return Refused(tool_use_id, tool, "invalid", why, machine)
    return ToMachine(tool_use_id, tool, machine, {**args, "machine": machine}, deadline_ms)


def _fan_out(
    tool_use_id: str,
    tool: str,
    args: dict[str, Any],
    rules: RoutingRules,
    fleet: Fleet,
    deadline_ms: int,
) -> FanOut | Refused:
    """A `machines` call's copies, or its refusal (the module docstring)."""
    text = args[MACHINES_ARG]
    if args.get("machine") is not None:
        why = f"{tool} takes 'machine' (one name) or 'machines' (a selector), not both"
        return Refused(tool_use_id, tool, "invalid", why)
    try:
        if not isinstance(text, str):
            raise SelectorError(repr(text)[:60], 0, "a selector is a string, such as role=web")
        selector = parse_selector(text)
    except SelectorError as exc:
        return Refused(tool_use_id, tool, "invalid", f"'machines': {exc}")
    names = [m for m in fleet.online if selector.matches(fleet.labels.get(m, {}))]
    if not names:
        why = f"no machine online matches the selector '{text}'; {label_groups(fleet.labels)}"
        return Refused(tool_use_id, tool, "invalid", why)
    if len(names) > rules.max_fanout:
        why = (
            f"the selector '{text}' matches {len(names)} machines, more than this run's "
            f"max_fanout ({rules.max_fanout}); narrow it"
        )
        return Refused(tool_use_id, tool, "invalid", why)
    offering = fleet.offered.get(tool, frozenset())
    copies = tuple(
        ToMachine(
            copy_id(tool_use_id, m, rules.copy_key), tool, m, copy_input(args, m), deadline_ms
        )
        if m in offering
        else Refused(
            copy_id(tool_use_id, m, rules.copy_key),
            tool,
            "invalid",
            f"{m} does not offer {tool}",
            m,
        )
        for m in sorted(names, key=name_key)
    )
    return FanOut(tool_use_id, tool, copies)


def offline_message(machine: str, fleet: Fleet) -> str:
    """Why a call to `machine` was refused: offline (or never known), and which online
    names it may have meant."""
    if not fleet.online:
        return f"machine {machine} is offline; no machine is online"
    closest = difflib.get_close_matches(machine, fleet.online, n=CLOSEST_AT_MOST, cutoff=0.5)
    if closest:
        return f"machine {machine} is offline; closest online names: {', '.join(closest)}"
    return f"machine {machine} is offline; list_machines lists the machines online"


def offered_by(machines: Collection[str]) -> str:
    """Which machines offer a tool, in a bounded sentence: sorted names, at most
    `NAMED_AT_MOST` of them, then how many more."""
    if not machines:
        return "no machine online offers it"
    names = sorted(machines)
    shown = ", ".join(names[:NAMED_AT_MOST])
    more = len(names) - NAMED_AT_MOST
    return f"offered by {shown}" + (f" and {more} more" if more > 0 else "")


def route_calls(
    tool_uses: Sequence[Mapping[str, Any]], rules: RoutingRules, fleet: Fleet, now_ms: int
) -> list[Route | FanOut]:
    return [route_call(tool_use, rules, fleet, now_ms) for tool_use in tool_uses]


def expanded(routes: Sequence[Route | FanOut]) -> list[Route]:
    """Routes with each fan-out's copies in its place."""
    return [c for r in routes for c in (r.copies if isinstance(r, FanOut) else (r,))]


def reply_routes(
    tool_uses: Sequence[Mapping[str, Any]],
    repairs: Mapping[str, str],
    rules: RoutingRules,
    fleet: Fleet,
    now_ms: int,
    *,
    sent: Mapping[str, ToMachine],
    cancelled: str | None,
    sequential: bool,
) -> tuple[list[Route], dict[str, int]]:
    """A reply's routes, in the model's order, and each call's own timeout
    (`own_timeout_ms`). `sent`: calls already sent while the reply streamed, kept as
    they went. Any other call is refused when it was repaired, and when an operation
    cancel (`cancelled`, its reason) came while the sent ones ran. A fan-out's copies
    take its place (each copy of a repaired or cancelled one refused alike)."""
    routed = expanded(route_calls(tool_uses, rules, fleet, now_ms))
    routes = [sent.get(r.tool_use_id, r) for r in routed]
    timeouts = {r.tool_use_id: own_timeout_ms(r, rules, now_ms) for r in routes}
    if sequential:
        routes = sequential_deadlines(routes, rules, now_ms)
    routes = [r if r.tool_use_id in sent else _refused(r, repairs, cancelled) for r in routes]
    return routes, timeouts


def _refused(route: Route, repairs: Mapping[str, str], cancelled: str | None) -> Route:
    """The call's route, or its refusal: repaired (not runnable), or a cancel's."""
    repaired = repairs.get(parent_id(route.tool_use_id))
    if repaired is not None:
        return Refused(route.tool_use_id, route.tool, "invalid", repaired)
    if cancelled is not None and not isinstance(route, Refused):
        # No machine: recovery, finding it unanswered, must not send it there.
        why = f"cancelled ({cancelled}) before it started"
        return Refused(route.tool_use_id, route.tool, "cancelled", why)
    return route


def own_timeout_ms(route: Route, rules: RoutingRules, now_ms: int) -> int:
    """The time a call routed at `now_ms` may take once it starts (0: a refused call).
    A sequential turn stores it with each call, whose deadline is set when it is sent."""
    if isinstance(route, Refused):
        return 0
    return route.deadline_ms - rules.grace_ms - now_ms


def sequential_deadlines(routes: Sequence[Route], rules: RoutingRules, now_ms: int) -> list[Route]:
    """Calls run one after another: each may take its own timeout after the ones before
    it, so the watchdog's deadline of call i, as planned, is the sum of the timeouts up
    to i (each call's own deadline is set again when it is sent: `own_timeout_ms`)."""
    elapsed_ms = 0
    shifted: list[Route] = []
    for route in routes:
        if isinstance(route, Refused):
            shifted.append(route)
            continue
        elapsed_ms += own_timeout_ms(route, rules, now_ms)
        deadline = min(now_ms + elapsed_ms, rules.run_deadline_ms) + rules.grace_ms
        shifted.append(replace(route, deadline_ms=deadline))
    return shifted
