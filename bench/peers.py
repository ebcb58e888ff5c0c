"""3. Peers: one scripted conversation, run by our fleet and by two in-process loops.

5 turns of 4 tool calls, each tool a 200 ms wait, then a final answer; the fake model
answers every request after 50 ms. The same fake server and script serve all three
loops (`bench.loops`: the fleet through `Client` on 2 machine workers, 2 calls each per
turn; the anthropic SDK's `tool_runner`, tools one by one; pydantic-ai, tools at once).
Ideal (tools in parallel, zero overhead): 5 x (200 + 50) + 50 = 1300 ms.

After one untimed 1-turn warm-up of each loop, the three are interleaved so a shared
machine's drifting load hits them alike: 6 rounds (3 with --quick, of 2 turns), each
running all three once, the order rotated per round so each loop goes first, second
and third equally often. Reported times are medians across rounds, and the ratios are
of those medians; the spread of the per-round ratios is shown beside them.
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

from bench.common import Result, Stack, spread, text, tool_use
from bench.loops import Timer, add_ratios, interleaved, peer_timers, time_fleet

NAME = "peers"
TURNS, TOOLS, TOOL_MS, LATENCY_MS = 5, 4, 200, 50
QUICK_TURNS = 2
TITLES = {
    "tool_runner": "anthropic tool_runner (in-process)",
    "pydantic_ai": "pydantic-ai (in-process)",
}
TARGETS = {"pydantic_ai": 1.0}


def ideal_ms(turns: int) -> int:
    return turns * (TOOL_MS + LATENCY_MS) + LATENCY_MS


def conversation(machines: list[str], turns: int) -> list[Any]:
    def call(machine: str) -> dict[str, Any]:
        return tool_use("bench_sleep", ms=TOOL_MS, machine=machine)

    return [spread(machines, TOOLS, call) for _ in range(turns)] + [text("done")]


def timers(st: Stack, turns: int) -> dict[str, Timer]:
    """Per loop, a call that runs the `turns`-turn conversation once and returns its ms."""
    prompt = st.script(conversation(st.machines, turns), latency_ms=LATENCY_MS)
    return {
        "fleet": partial(time_fleet, st.client, prompt, turns),
        **peer_timers(st.fake.url, prompt),
    }


def run(quick: bool) -> Result:
    res = Result(NAME)
    rounds, turns = (3, QUICK_TURNS) if quick else (6, TURNS)
    with Stack(env={"CMDOP_WORKER_CONCURRENCY": "8"}) as st:
        for warm in timers(st, 1).values():  # lazy clients, connection pools
            warm()
        times = interleaved(timers(st, turns), rounds)
    ideal = ideal_ms(turns)
    res.raw = {"ms": times, "ideal_ms": ideal, "turns": turns, "rounds": rounds}
    fleet = times["fleet"]
    res.add(
        f"fleet: {turns} turns x {TOOLS} parallel {TOOL_MS} ms tools, {LATENCY_MS} ms model",
        statistics.median(fleet),
        "ms",
        f"median of {rounds} rounds (min {min(fleet):.0f}, max {max(fleet):.0f}); ideal {ideal}",
        f"{statistics.median(fleet) / ideal:.2f}x ideal",
    )
    add_ratios(res, times, TITLES, targets=TARGETS)
    return res
