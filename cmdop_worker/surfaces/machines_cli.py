"""`cmdop-worker machines` and the labels a machine worker starts with.

    cmdop-worker machines [--selector SELECTOR] [--json]
        the machines online, with their labels; a label selector (`role=web,env!=staging`,
        `region in (eu,us)`, `!canary`, `*`) keeps those it matches; exit 2 when the
        selector does not parse (where, and what was expected, on stderr)
    cmdop-worker worker --machine NAME [--label KEY=VALUE ...]
        `machine_labels` puts CMDOP_MACHINE_LABELS and the flags together, or says why not

Thin, as the rest of the CLI: parse, call the client, print (what machines registered
through `screen.terminal_safe`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from cmdop_worker.core.selectors import EVERY, SelectorError, parse_selector
from cmdop_worker.models import parse_labels
from cmdop_worker.surfaces.follow import EXIT_OK, EXIT_USAGE
from cmdop_worker.surfaces.screen import terminal_safe


def add_machines_command(sub: Any) -> None:
    machines = sub.add_parser("machines", help="list the machines online")
    machines.add_argument("--json", action="store_true", help="one JSON array of presences")
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
