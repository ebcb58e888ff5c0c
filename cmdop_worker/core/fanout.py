"""One call, many machines: a fan-out's copies and the one result the model reads.

Pure. A machine-bound call given `machines: "<selector>"` (`core.routing`) becomes one
copy per matching machine, each an ordinary machine call with its own id,
`copy_id(tool_use_id, machine)`: derived, never drawn, so a re-sent turn names the
same copies and each copy runs at most once by its id (the barrier's start record).
The copies are the turn's pending calls; `core.results.collected` merges the outcomes
of one call's copies into one tool_result with `merged_outcome`.

The merged text groups machines by identical outcome (status and output, the exit code
being part of the output), largest group first, outliers one by one:

    execute_command on 50 machines: 48 ok, 1 denied, 1 offline
    web-01…web-47, db-1 (48): ok, exit 0: "/ 23% used"
    web-48 (1): denied: "command denied by policy: rm"
    web-49 (1): offline: "machine web-49 is offline"

It is bounded (`FANOUT_TEXT_MAX_CHARS`) whatever the fleet: each group's names are
shortened to runs (`web-01…web-47`) and at most `NAMES_AT_MOST` items, its output to
a share of the budget, and the groups that do not fit are counted by status in a last
line. Called by `core.results` and `core.routing`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cmdop_worker.models import ToolOutcome, ToolStatus, Usage

DEFAULT_MAX_FANOUT = 100
COPY_MARK = "@"  # in neither a tool_use id (`toolu_…`) nor a machine name
COPY_TAG_HEX = 16
_COPY_TAG_RE = re.compile(rf"#[0-9a-f]{{{COPY_TAG_HEX}}}\Z")
FANOUT_TEXT_MAX_CHARS = 8_000
NAMES_AT_MOST = 12  # name items (single names or runs) a group line shows
EXCERPT_MAX_CHARS = 2_000
EXCERPT_MIN_CHARS = 60
MACHINES_ARG = "machines"
_EXIT_RE = re.compile(r"\Aexit_code: (-?\d+)\n?")
_NUMBERED_RE = re.compile(r"\A(.*?)(\d+)\Z")


def copy_id(tool_use_id: str, machine: str, key: str = "") -> str:
    """The id of the copy of call `tool_use_id` that runs on `machine`: derived, so a
    re-sent turn names the same copies, and with the run's `key` (`RunState.copy_key`,
    which no machine can read) tagged so that no machine can derive another machine's
    copy id from its own and write that copy's outcome first."""
    base = f"{tool_use_id}{COPY_MARK}{machine}"
    if not key:
        return base
    tag = hmac.new(key.encode(), base.encode(), hashlib.sha256).hexdigest()[:COPY_TAG_HEX]
    return f"{base}#{tag}"


def parent_id(call_id: str) -> str:
    """The model's tool_use id a copy belongs to (a call that is no copy: itself)."""
    return call_id.split(COPY_MARK, 1)[0]


def copy_machine(call_id: str) -> str | None:
    """The machine a copy runs on (None: not a copy)."""
    parts = call_id.split(COPY_MARK, 1)
    return _COPY_TAG_RE.sub("", parts[1]) if len(parts) == 2 else None


def is_copy(call_id: str) -> bool:
    return COPY_MARK in call_id


def copy_input(args: Mapping[str, Any], machine: str) -> dict[str, Any]:
    """A copy's input: the call's own, addressed to one machine."""
    return {**{k: v for k, v in args.items() if k != MACHINES_ARG}, "machine": machine}


def copy_inputs(inputs: Mapping[str, Any], call_ids: Iterable[str]) -> dict[str, Any]:
    """The input of each copy among `call_ids`, from its call's input in `inputs`."""
    found: dict[str, Any] = {}
    for call_id in call_ids:
        machine, args = copy_machine(call_id), inputs.get(parent_id(call_id))
        if machine is not None and isinstance(args, Mapping):
            found[call_id] = copy_input(args, machine)
    return found


def batches(call_ids: Sequence[str], serial: int | None) -> dict[str, list[list[str]]]:
    """Each fan-out's copies among `call_ids` (in their order) cut into batches of
    `serial` (Ansible's word): the next batch starts when the one before has ended. Only
    fan-outs with more copies than one batch are given; None or 0: all at once."""
    if not serial or serial < 1:
        return {}
    copies: dict[str, list[str]] = {}
    for call_id in call_ids:
        if is_copy(call_id):
            copies.setdefault(parent_id(call_id), []).append(call_id)
    return {
        parent: [ids[i : i + serial] for i in range(0, len(ids), serial)]
        for parent, ids in copies.items()
        if len(ids) > serial
    }


def batch_number(plan: Mapping[str, Sequence[Sequence[str]]]) -> dict[str, int]:
    """Each batched copy's batch, counted from 0."""
    return {cid: n for chain in plan.values() for n, batch in enumerate(chain) for cid in batch}


@dataclass(frozen=True)
class Group:
    """Machines whose copies ended alike."""

    machines: tuple[str, ...]  # sorted by `name_key`
    status: ToolStatus
    output: str


def name_key(name: str) -> tuple[str, int, str]:
    """Natural order: web-2 before web-10."""
    match = _NUMBERED_RE.match(name)
    if match is None:
        return name, -1, name
    return match.group(1), int(match.group(2)), name


def outcome_groups(outcomes: Iterable[tuple[str, ToolOutcome]]) -> list[Group]:
    """The (machine, outcome) pairs grouped by status and output: largest group first,
    then by first machine. Each machine lands in exactly one group (a machine given
    twice: its first outcome)."""
    by_outcome: dict[tuple[ToolStatus, str], list[str]] = {}
    seen: set[str] = set()
    for machine, outcome in outcomes:
        if machine in seen:
            continue
        seen.add(machine)
        by_outcome.setdefault((outcome.status, outcome.output), []).append(machine)
    groups = [
        Group(tuple(sorted(names, key=name_key)), status, output)
        for (status, output), names in by_outcome.items()
    ]
    return sorted(groups, key=lambda g: (-len(g.machines), name_key(g.machines[0])))


def name_runs(names: Sequence[str]) -> list[str]:
    """Sorted names as items: three or more consecutive numbers under one prefix and
    width become one run, `web-01…web-47`."""
    items: list[str] = []
    run: list[str] = []
    for name in names:
        if run and _follows(run[-1], name):
            run.append(name)
            continue
        items.extend(_run_items(run))
        run = [name]
    items.extend(_run_items(run))
    return items


def _follows(before: str, name: str) -> bool:
    a, b = _NUMBERED_RE.match(before), _NUMBERED_RE.match(name)
    if a is None or b is None or a.group(1) != b.group(1):
        return False
    same_width = len(a.group(2)) == len(b.group(2)) or not a.group(2).startswith("0")
    return same_width and int(b.group(2)) == int(a.group(2)) + 1


def _run_items(run: list[str]) -> list[str]:
    return [f"{run[0]}…{run[-1]}"] if len(run) >= 3 else list(run)


def names_text(names: Sequence[str], at_most: int = NAMES_AT_MOST) -> str:
    items = name_runs(names)
    shown = ", ".join(items[:at_most])
    more = len(items) - at_most
    return shown + (f" and {more} more" if more > 0 else "")


def _excerpt(output: str, max_chars: int) -> tuple[str, str]:
    """`, exit N` (from a command's `exit_code: N` first line) and the rest, quoted on
    one line and cut to `max_chars`."""
    exit_part = ""
    match = _EXIT_RE.match(output)
    if match is not None:
        exit_part, output = f", exit {match.group(1)}", output[match.end() :]
        output = output.removeprefix("--- stdout ---\n")
    text = output.strip()
    if len(text) > max_chars:
        text = text[: max(0, max_chars - 1)] + "…"
    return exit_part, json.dumps(text, ensure_ascii=False)


def group_line(group: Group, excerpt_chars: int) -> str:
    exit_part, quoted = _excerpt(group.output, excerpt_chars)
    names = names_text(group.machines)
    return f"{names} ({len(group.machines)}): {group.status}{exit_part}: {quoted}"


def _counts(groups: Sequence[Group]) -> str:
    counts: Counter[str] = Counter()
    for group in groups:
        counts[group.status] += len(group.machines)
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{n} {status}" for status, n in ordered)


def fanout_text(
    tool: str, groups: Sequence[Group], *, max_chars: int = FANOUT_TEXT_MAX_CHARS
) -> str:
    """The model's one text for a fan-out (the module docstring), at most `max_chars`."""
    total = sum(len(g.machines) for g in groups)
    lines = [f"{tool} on {total} machine{'s' if total != 1 else ''}: {_counts(groups)}"]
    share = (max_chars - len(lines[0])) // max(1, min(len(groups), 20)) - 120
    excerpt_chars = min(EXCERPT_MAX_CHARS, max(EXCERPT_MIN_CHARS, share))
    reserve = 200  # the last line, counting the groups that did not fit
    used = len(lines[0])
    for shown, group in enumerate(groups):
        line = group_line(group, excerpt_chars)
        if used + 1 + len(line) > max_chars - reserve:
            rest = groups[shown:]
            machines = sum(len(g.machines) for g in rest)
            lines.append(f"… {len(rest)} more groups ({machines} machines): {_counts(rest)}")
            break
        lines.append(line)
        used += 1 + len(line)
    return "\n".join(lines)[:max_chars]


def merged_outcome(
    tool_use_id: str,
    tool: str,
    copies: Sequence[tuple[str, ToolOutcome]],
    *,
    max_chars: int = FANOUT_TEXT_MAX_CHARS,
) -> ToolOutcome:
    """One outcome for a fan-out's copies, given as (machine, outcome): the grouped
    text; `ok` when any copy succeeded (the text says which did not), else the status
    of the largest group; what the copies spent on the model, summed."""
    groups = outcome_groups(copies)
    status: ToolStatus = "ok"
    if groups and not any(g.status == "ok" for g in groups):
        status = groups[0].status
    usage = _usage_sum([o.usage for _, o in copies if o.usage is not None])
    text = fanout_text(tool, groups, max_chars=max_chars)
    duration = max((o.duration_ms for _, o in copies), default=0)
    return ToolOutcome(
        tool_use_id=tool_use_id,
        tool=tool,
        status=status,
        output=text,
        duration_ms=duration,
        usage=usage,
    )


def label_groups(labels: Mapping[str, Mapping[str, str]], at_most: int = 20) -> str:
    """The label groups of the machines online, `role=web (47), role=db (3)`, for a
    selector that matched none: the most common first, at most `at_most`."""
    counts: Counter[str] = Counter()
    for machine_labels in labels.values():
        counts.update(f"{k}={v}" for k, v in machine_labels.items())
    if not counts:
        return "no machine online has labels"
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ", ".join(f"{label} ({n})" for label, n in items[:at_most])
    more = len(items) - at_most
    return "label groups online: " + shown + (f" and {more} more" if more > 0 else "")


def _usage_sum(usages: Sequence[Usage]) -> Usage | None:
    total = usages[0] if usages else None
    for usage in usages[1:]:
        total = total + usage if total is not None else usage
    return total
