"""`cmdop-worker machines` and the labels a machine worker starts with.

    cmdop-worker machines [--all] [--selector SELECTOR] [--json]
        the machines online, with their labels; a label selector (`role=web,env!=staging`,
        `region in (eu,us)`, `!canary`, `*`) keeps those it matches; exit 2 when the
        selector does not parse (where, and what was expected, on stderr). `--all` adds
        every machine the fleet has seen that is offline now, with when it was last seen
        (an offline machine's labels are not known: a selector leaves those out)
    cmdop-worker worker --machine NAME [--label KEY=VALUE ...]
        `machine_labels` puts CMDOP_MACHINE_LABELS and the flags together, or says why not

Thin, as the rest of the CLI: parse, call the client, print (what machines registered
through `screen.terminal_safe`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from cmdop_worker.core.machine_names import ago
from cmdop_worker.core.selectors import EVERY, Selector, SelectorError, parse_selector, selected
from cmdop_worker.models import parse_labels
from cmdop_worker.surfaces.follow import EXIT_OK, EXIT_USAGE
from cmdop_worker.surfaces.screen import terminal_safe


def add_machines_command(sub: Any) -> None:
    machines = sub.add_parser("machines", help="list the machines online")
    machines.add_argument("--json", action="store_true", help="one JSON array of presences")
    machines.add_argument(
        "--all",
        action="store_true",
        help="also the machines seen before that are offline now, with when last seen",
    )
    machines.add_argument(
        "--selector", help="only the machines this label selector matches: role=web,env!=staging"
    )


def add_label_option(worker: argparse.ArgumentParser) -> None:
    worker.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a machine label (repeatable), over those of CMDOP_MACHINE_LABELS",
    )


def cmd_machines(args: argparse.Namespace, client: Any) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    try:
        selector = EVERY if args.selector is None else parse_selector(args.selector)
    except SelectorError as exc:
        print(f"cmdop-worker: {exc}\n{terminal_safe(exc.pointer())}", file=sys.stderr)
        return EXIT_USAGE
    if args.all:
        return _all_machines(client, selector, as_json=args.json)
    machines = client.machines(selector)
    if args.json:
        print(json.dumps([m.model_dump(mode="json") for m in machines]))
        return EXIT_OK
    table = Table("machine", "labels", "host", "pid", "sandbox", "tools")
    for m in machines:
        tools = ", ".join(t.name for t in m.tools)
        sandbox = (m.sandbox or "?") + (", open redis" if m.open_redis else "")
        # What a machine registered is shown as text: no markup, no control characters.
        cells = (m.machine, shown_labels(m.labels), m.host, str(m.pid), sandbox, tools)
        table.add_row(*(Text(terminal_safe(cell)) for cell in cells))
    nothing = "no machines online" + ("" if selector.everything else f" match {selector}")
    Console().print(table if machines else nothing)
    return EXIT_OK


def _all_machines(client: Any, selector: Selector, *, as_json: bool) -> int:
    """Every machine the fleet has seen: those online (the selector matches) and, with
    no selector, those offline with when they were last seen."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from cmdop_worker.state.seen import known_machines

    known = known_machines(client.redis, client.keys)
    online = {m.machine for m in selected([k.presence for k in known if k.presence], selector)}
    shown = [k for k in known if k.machine in online or (not k.online and selector.everything)]
    if as_json:
        print(json.dumps([_known_json(k) for k in shown]))
        return EXIT_OK
    now_ms = int(time.time() * 1000)
    table = Table("machine", "state", "last seen", "labels", "host", "pid", "tools")
    for k in shown:
        m = k.presence
        last = "now" if m else "?" if k.last_seen_ms is None else last_seen(k.last_seen_ms, now_ms)
        cells = (k.machine, "online" if m else "offline", last) + (
            (shown_labels(m.labels), m.host, str(m.pid), ", ".join(t.name for t in m.tools))
            if m
            else ("", "", "", "")
        )
        table.add_row(*(Text(terminal_safe(cell)) for cell in cells))
    Console().print(table if shown else "no machine has joined this fleet yet")
    return EXIT_OK


def _known_json(known: Any) -> dict[str, Any]:
    presence = known.presence.model_dump(mode="json") if known.presence else {}
    last = {"last_seen_ms": known.last_seen_ms}
    return {**presence, "machine": known.machine, "online": known.online, **last}


def last_seen(at_ms: int, now_ms: int) -> str:
    """When a machine was last seen: how long ago, and the UTC time."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at_ms / 1000))
    return f"{ago(now_ms - at_ms)} ago ({stamp})"


def shown_labels(labels: Mapping[str, str]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(labels.items()))


def machine_labels(env: str, flags: Sequence[str], *, machine: bool) -> str:
    """CMDOP_MACHINE_LABELS with each `--label` over it, key by key, as the worker's
    settings read it; ValueError saying what is wrong (a label, or one without --machine)."""
    if flags and not machine:
        raise ValueError("--label names a machine's labels: it goes with --machine")
    labels = parse_labels(env)
    labels.update(parse_labels(",".join(flags)))
    return ",".join(f"{key}={value}" for key, value in labels.items())
