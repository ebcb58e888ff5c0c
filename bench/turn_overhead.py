"""1. Turn overhead: what the loop adds to a turn, against a bare Celery chord.

Two runs of 20 turns (one of 6 with --quick), each turn 8 `bench_noop` calls (a true
no-op user tool from `bench.tools`, so no shell is spawned) over 2 machines, with a
zero-latency model; then 10 turns of `execute_command true` to show a shell's cost.
For turn n: wall = the fake server receiving request n+1 minus receiving request n;
model = the server's own time on request n (received -> response fully written);
tools = the longest `duration_ms` among the turn's TOOL_END events. Overhead = wall -
model - tools: the SDK on both ends, routing, state load/save, events, the barrier,
the next turn's hop and request building.

Baseline: `bare_chord` (8 no-op tasks over 2 queues, callback on a third, the fleet's
Celery config, pool and concurrency), publish start -> callback running.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.bare_chord import BareChord
from bench.common import (
    Result,
    Stack,
    pct,
    requests_for,
    spread,
    summary,
    text,
    tool_use,
    wall_to_mono_ms,
)
from cmdop_worker.models import Event

NAME = "overhead"
CONCURRENCY = 16  # the product's default worker concurrency, for the fleet and the chord
TARGET_RATIO = 1.2


def turn_samples(recs: list[dict[str, Any]], events: list[Event]) -> list[dict[str, float]]:
    """Per tool turn: wall, model, tools, overhead and where the overhead sits (ms)."""
    offset = wall_to_mono_ms()
    by_turn: dict[tuple[int, str], list[Event]] = defaultdict(list)
    for event in events:
        by_turn[event.turn, event.type].append(event)
    samples = []
    for i in range(len(recs) - 1):
        ends, starts = by_turn[i + 1, "TOOL_END"], by_turn[i + 1, "TOOL_START"]
        if not ends or not starts:
            continue
        wall = recs[i + 1]["received_ms"] - recs[i]["received_ms"]
        model = recs[i]["sent_ms"] - recs[i]["received_ms"]
        tools = max(e.data.get("duration_ms") or 0 for e in ends)
        samples.append(
            {
                "wall": wall,
                "model": model,
                "tools": tools,
                "overhead": wall - model - tools,
                "reply_to_first_start": min(e.ts_ms for e in starts) + offset - recs[i]["sent_ms"],
                "last_end_to_next_request": recs[i + 1]["received_ms"]
                - (max(e.ts_ms for e in ends) + offset),
            }
        )
    return samples


def fleet_turns(st: Stack, turns: int, make: Any) -> list[dict[str, float]]:
    prompt = st.script([spread(st.machines, 8, make) for _ in range(turns)] + [text("done")])
    run = st.client.submit(prompt=prompt, max_turns=turns + 2, timeout_s=300)
    result = run.wait(timeout=180)
    if result.turns != turns + 1:
        raise RuntimeError(f"run ended after {result.turns} turns ({result.stop_reason})")
    return turn_samples(requests_for(st.fake, prompt), st.events(run.run_id))


def noop(machine: str) -> dict[str, Any]:
    return tool_use("bench_noop", machine=machine)


def shell_true(machine: str) -> dict[str, Any]:
    return tool_use("execute_command", machine=machine, command="true")


def run(quick: bool) -> Result:
    res = Result(NAME)
    turns, runs, chords = (6, 1, 10) if quick else (20, 2, 60)
    env = {"CMDOP_WORKER_CONCURRENCY": str(CONCURRENCY)}
    with Stack(env=env) as st:
        fleet_turns(st, 1, noop)  # warm-up: lazy clients, connection pools
        samples = [s for _ in range(runs) for s in fleet_turns(st, turns, noop)]
        shell = [] if quick else fleet_turns(st, 10, shell_true)
    with (
        tempfile.TemporaryDirectory(prefix="cmdop-bare-") as logdir,
        BareChord(CONCURRENCY, Path(logdir)) as bare,
    ):
        for _ in range(3):
            bare.once()
        timings = [bare.once() for _ in range(chords)]
    chord = [total for _, total in timings]
    publish = [pub for pub, _ in timings]
    over = [s["overhead"] for s in samples]
    res.raw = {
        "turns": {k: summary([s[k] for s in samples]) for k in samples[0]},
        "bare_chord_ms": summary(chord),
        "bare_publish_ms": summary(publish),
        "shell_true_turns": {k: summary([s[k] for s in shell]) for k in shell[0]} if shell else {},
        "samples": samples,
        "config": {"turns": turns, "runs": runs, "chords": chords, "concurrency": CONCURRENCY},
    }
    for p in (50, 95):
        ratio = pct(over, p) / pct(chord, p)
        res.add(
            f"per-turn overhead p{p} (8 no-op tools, 2 machines)",
            pct(over, p),
            "ms",
            f"bare chord p{p} {pct(chord, p):.1f} ms; target <= {TARGET_RATIO}x",
            f"{ratio:.2f}x {'ok' if ratio <= TARGET_RATIO else 'MISS'}",
        )
    res.add(
        "  bare chord: client-side publish p50",
        pct(publish, 50),
        "ms",
        f"of the chord's {pct(chord, 50):.1f} ms",
    )
    median = {k: pct([s[k] for s in samples], 50) for k in samples[0]}
    res.add(
        "  turn wall p50",
        median["wall"],
        "ms",
        f"model {median['model']:.1f}; reply->1st TOOL_START {median['reply_to_first_start']:.0f};"
        f" last TOOL_END->next request {median['last_end_to_next_request']:.0f}",
    )
    if shell:
        res.add(
            "  overhead p50 with execute_command `true`",
            pct([s["overhead"] for s in shell], 50),
            "ms",
            f"turn wall {pct([s['wall'] for s in shell], 50):.1f} ms",
        )
    return res
