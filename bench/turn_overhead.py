"""1. Turn overhead: what the loop adds to a turn, against a bare Celery chord.

Each turn is 8 `bench_noop` calls (a true no-op user tool from `bench.tools`, so no
shell is spawned) over 2 machines, with a zero-latency model. For turn n: wall = the
fake server receiving request n+1 minus receiving request n; model = the server's own
time on request n (received -> response fully written); tools = the longest
`duration_ms` among the turn's TOOL_END events. Overhead = wall - model - tools: the
SDK on both ends, routing, state load/save, events, the barrier, the next turn's hop
and request building. Then 10 turns of `execute_command true` show a shell's cost
(not with --quick).

Baseline: `bare_chord` (8 no-op tasks over 2 queues, callback on a third, the fleet's
Celery config, pool and concurrency), publish start -> callback running.

The baseline is stock Celery: the fleet's kombu patch (one Redis client per channel,
see `bare_chord`) makes every task cheaper, so the same chord on patched kombu is
measured beside it and its ratio reported too.

Both worlds are up at once, each with its own Redis, and the measurement interleaves
them so a shared machine's drifting load hits both alike: 10 rounds (4 with --quick),
each one fleet run of 12 turns (5) and as many bare chords, the order alternating per
round; whichever world is not being measured sits idle. The p50/p95 ratios pool every
round; the per-round ratios (overhead p50 / chord p50) show how much the noise moves it.
"""

from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
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
TARGET_RATIO = 0.8  # at p50, against the stock chord


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


@dataclass
class Round:
    """One interleaved round: a fleet run's turn samples and as many bare chords."""

    fleet_first: bool
    turns: list[dict[str, float]]
    chords: list[tuple[float, float]]  # (publish ms, publish start -> callback ms)
    patched: list[float]  # the same chord on kombu as the fleet patches it (total ms)

    @property
    def overhead_p50(self) -> float:
        return pct([s["overhead"] for s in self.turns], 50)

    @property
    def chord_p50(self) -> float:
        return pct([total for _, total in self.chords], 50)

    @property
    def ratio(self) -> float:
        return self.overhead_p50 / self.chord_p50


def one_round(
    st: Stack, bare: BareChord, patched: BareChord, turns: int, fleet_first: bool
) -> Round:
    """A fleet run of `turns` turns and `turns` bare chords of each kind, the fleet
    first or last."""

    def chords() -> tuple[list[tuple[float, float]], list[float]]:
        stock = [bare.once() for _ in range(turns)]
        return stock, [total for _, total in (patched.once() for _ in range(turns))]

    if fleet_first:
        samples = fleet_turns(st, turns, noop)
        stock, other = chords()
    else:
        stock, other = chords()
        samples = fleet_turns(st, turns, noop)
    return Round(fleet_first, samples, stock, other)


def run(quick: bool) -> Result:
    res = Result(NAME)
    rounds, turns = (4, 5) if quick else (10, 12)
    env = {"CMDOP_WORKER_CONCURRENCY": str(CONCURRENCY)}
    with ExitStack() as worlds:
        st = worlds.enter_context(Stack(env=env))
        logdir = worlds.enter_context(tempfile.TemporaryDirectory(prefix="cmdop-bare-"))
        bare = worlds.enter_context(BareChord(CONCURRENCY, Path(logdir) / "stock"))
        patched = worlds.enter_context(
            BareChord(CONCURRENCY, Path(logdir) / "patched", stock=False)
        )
        fleet_turns(st, 1, noop)  # warm-up: lazy clients, connection pools
        for _ in range(3):
            bare.once()
            patched.once()
        done = [one_round(st, bare, patched, turns, fleet_first=n % 2 == 0) for n in range(rounds)]
        shell = [] if quick else fleet_turns(st, 10, shell_true)
    samples = [s for r in done for s in r.turns]
    chord = [total for r in done for _, total in r.chords]
    publish = [pub for r in done for pub, _ in r.chords]
    over = [s["overhead"] for s in samples]
    ratios = [r.ratio for r in done]
    patched = [total for r in done for total in r.patched]
    res.raw = {
        "turns": {k: summary([s[k] for s in samples]) for k in samples[0]},
        "bare_chord_ms": summary(chord),
        "patched_chord_ms": summary(patched),
        "bare_publish_ms": summary(publish),
        "shell_true_turns": {k: summary([s[k] for s in shell]) for k in shell[0]} if shell else {},
        "rounds": [
            {
                "fleet_first": r.fleet_first,
                "overhead_p50_ms": r.overhead_p50,
                "chord_p50_ms": r.chord_p50,
                "ratio": r.ratio,
            }
            for r in done
        ],
        "samples": samples,
        "config": {"turns": turns, "rounds": rounds, "chords": turns, "concurrency": CONCURRENCY},
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
        "  per-round ratio, overhead p50 / chord p50",
        statistics.median(ratios),
        "x",
        f"median of {rounds} rounds x {turns} turns; min {min(ratios):.2f}, max {max(ratios):.2f}",
    )
    res.add(
        "  vs the chord on kombu patched as the fleet runs it, p50",
        pct(over, 50) / pct(patched, 50),
        "x",
        f"patched chord p50 {pct(patched, 50):.1f} ms (stock {pct(chord, 50):.1f})",
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
