"""The CLI's live view shows a call's time and the head of its output as the viewer does."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from cmdop_worker.models import Event
from cmdop_worker.surfaces.render import LiveView


def _shown(*events: tuple[str, int, dict[str, Any]]) -> list[str]:
    out = io.StringIO()
    view = LiveView(Console(file=out, force_terminal=False, width=200))
    for seq, (kind, ts_ms, data) in enumerate(events, start=1):
        view.show(Event(run_id="r1", seq=seq, type=kind, turn=1, ts_ms=ts_ms, data=data))
    view.close()
    return out.getvalue().splitlines()


def _call(**end: Any) -> dict[str, Any]:
    return {"tool_call_id": "t1", "tool": "execute_command", "machine": "web-1", **end}


def test_a_call_cancelled_after_three_seconds_shows_that_it_ran_three_seconds() -> None:
    lines = _shown(
        ("TOOL_START", 1_000, _call(input={"command": "sleep 60"})),
        (
            "TOOL_END",
            4_010,
            _call(is_error=True, status="cancelled", output="cancelled", duration_ms=0),
        ),
    )
    assert lines[-1].startswith("✗ execute_command on web-1 (3.01s) cancelled"), lines


def test_an_output_shows_its_first_lines_and_how_many_more() -> None:
    df = "exit_code: 0\nFilesystem Size\n/dev/sda1 50G\ntmpfs 1G\nshm 64M\n"
    end = _call(is_error=False, output=df, duration_ms=42, waited_ms=5_000)
    lines = _shown(("TOOL_START", 0, _call(input={})), ("TOOL_END", 6_000, end))
    assert lines[-4:] == [
        "✓ execute_command on web-1 (0.04s, waited 5.0s for approval) Filesystem Size",
        "  /dev/sda1 50G",
        "  tmpfs 1G",
        "  … 1 more line",
    ]


def test_the_summary_names_every_kind_of_token_and_the_cost() -> None:
    usage = {
        "input_tokens": 87,
        "cache_read_input_tokens": 2404,
        "output_tokens": 9,
        "cost_usd": 0.01,
    }
    (line,) = _shown(
        ("DONE", 2_000, {"text": "", "turns": 1, "stop_reason": "end_turn", "usage": usage})
    )[-1:]
    assert line.startswith(
        "── done: 1 turn · 87 in · 2404 cache read · 0 cache write · 9 out · $0.0100 · "
    )
    assert line.endswith(" · end_turn")
