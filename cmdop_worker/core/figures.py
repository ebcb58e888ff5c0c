"""The figures a person reads about a run, said one way on every screen.

The CLI's live view (`surfaces.render`) and the run viewer (`surfaces/static/viewer.js`,
which mirrors these functions line for line) show a run's usage, a tool call's time and
the head of its output alike, so the two never disagree on the same run:

- usage: `87 in · 2404 cache read · 0 cache write · 120 out · $0.0123`: input tokens
  billed at full price, read from the cache, written to it, output, and the cost
  (`cost unknown` once a call had a model without a price);
- a call's time: its own run time, and beside it the wait for a person's approval
  (`0.42s, waited 12.0s for approval`); a call answered for its tool (a cancel, a lost
  machine) has no run time of its own, so its TOOL_START to its TOOL_END is shown;
- its output: the first telling lines (not a bare `exit_code: 0` or a `--- stdout ---`
  marker), each cut to a width, and how many more there are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PREVIEW_LINES = 3
PREVIEW_WIDTH = 100


def usage_line(usage: Mapping[str, Any]) -> str:
    """A run's tokens and cost, as every screen shows them."""
    cost = usage.get("cost_usd", 0.0)
    parts = [
        f"{int(usage.get('input_tokens') or 0)} in",
        f"{int(usage.get('cache_read_input_tokens') or 0)} cache read",
        f"{int(usage.get('cache_creation_input_tokens') or 0)} cache write",
        f"{int(usage.get('output_tokens') or 0)} out",
        "cost unknown" if cost is None else f"${float(cost):.4f}",
    ]
    return " · ".join(parts)


def took(duration_ms: int, waited_ms: int = 0, *, elapsed_ms: int | None = None) -> str:
    """A call's time: `duration_ms` it ran (or, when it never said, `elapsed_ms` from its
    start to its end as the events show them), and the wait for approval beside it."""
    ran_ms = duration_ms if duration_ms > 0 or elapsed_ms is None else max(elapsed_ms, 0)
    text = f"{ran_ms / 1000:.2f}s"
    if waited_ms > 0:
        text += f", waited {waited_ms / 1000:.1f}s for approval"
    return text


def preview(output: str, *, lines: int = PREVIEW_LINES, width: int = PREVIEW_WIDTH) -> list[str]:
    """The head of a tool's output: its first `lines` telling lines, each at most
    `width` characters, then `… N more lines` when there are more."""
    telling = [
        line.rstrip()
        for line in output.strip().splitlines()
        if line.strip() and not line.startswith("--- ")
    ]
    if len(telling) > 1 and telling[0] == "exit_code: 0":
        telling = telling[1:]
    shown = [line if len(line) <= width else line[: width - 1] + "…" for line in telling[:lines]]
    if len(telling) > lines:
        more = len(telling) - lines
        shown.append(f"… {more} more line{'' if more == 1 else 's'}")
    return shown
