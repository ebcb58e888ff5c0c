"""Paced peers: the fleet against in-process loops on a model that writes at 80 tokens/s.

The fake model is paced (`pace_tps`, `fake_wire`): it writes 80 output tokens a second,
4 characters a token, a tool_use costing its input's JSON, and streams each delta when
its tokens are written, so a reply's first tool_use closes (`content_block_stop`)
while the others are still being written. That is what eager dispatch uses: a call
goes to its machine at its own block's end, not at `message_stop`. A reply sent whole
(the peers do not stream) comes after all of its tokens.

The script: 5 turns of 4 `bench_sleep` calls, 1.5 s, 0.2 s, 0.2 s and 0.05 s, the long
one first, second, third, fourth and first again, then the answer "done"; 50 ms to the
first token of every reply. Each call's input carries a `note` of ~90 characters, so
it is ~130 characters of JSON, the size of a shell call with its description: ~33
tokens, ~0.4 s to write.
Calls go round-robin to 2 machine workers; the peers run the same `bench_sleep`
in-process (`bench.loops`). Ideals (zero overhead, from the fake's own token count):
"eager" starts each call at its block's end; "after the reply" starts all of a turn's
calls at its end, as pydantic-ai does (tool_runner then runs them one by one).

Contenders, on the same paced server and script: the fleet with streaming (on by
default) submitted through `Client`; pydantic-ai; tool_runner; and a second fleet with
`CMDOP_EAGER_DISPATCH=false` (its own Redis and workers, idle while not measured).
After an untimed warm-up (a 0-tool run of each), 5 rounds (1 of 2 turns with --quick),
each running every contender once in rotated order (`bench.loops.interleaved`);
medians across rounds, and their ratios.
"""

from __future__ import annotations

import json
import statistics
from contextlib import ExitStack
from functools import partial
from typing import Any

from bench.common import Result, Stack, open_stacks, text, tool_use
from bench.loops import Timer, add_ratios, interleaved, peer_timers, time_fleet
from cmdop_worker.testing import fake_wire as fw
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from cmdop_worker.testing.fake_script import DEFAULT_PACE_TPS

NAME = "paced"
LATENCY_MS = 50
# Tool durations (ms) per turn: the long call moves through every position.
DURATIONS_MS = (
    (1500, 200, 200, 50),
    (200, 1500, 50, 200),
    (50, 200, 1500, 200),
    (200, 50, 200, 1500),
    (1500, 50, 200, 200),
)
NOTES = (  # ~100 characters: a shell call's command and description are about this long
    "Check free space on / and /var, then list the five largest directories under /var/log",
    "Read the last 200 lines of the nginx error log and count the upstream timeouts per minute",
    "List the failed systemd units with the latest status line of each and when it last restarted",
    "Compare the deployed release tag with the inventory's and show the commits between the two",
)
ANSWER = "done"
TITLES = {
    "pydantic_ai": "pydantic-ai (in-process, tools at once)",
    "tool_runner": "anthropic tool_runner (in-process, one by one)",
    "fleet_no_eager": "fleet, CMDOP_EAGER_DISPATCH=false",
}
TARGETS = {"pydantic_ai": 0.8}


def conversation(machines: list[str], turns: int) -> list[Any]:
    script: list[Any] = [
        [
            tool_use("bench_sleep", ms=ms, machine=machines[i % len(machines)], note=NOTES[i])
            for i, ms in enumerate(DURATIONS_MS[t])
        ]
        for t in range(turns)
    ]
    return [*script, text(ANSWER)]


def write_s(block: dict[str, Any]) -> float:
    """How long the paced model takes to write a block's output."""
    return fw.token_seconds(fw.block_chars(block), DEFAULT_PACE_TPS)


def ideal_ms(script: list[Any]) -> dict[str, float]:
    """Each ideal, zero overhead: per turn the first token's latency, the calls' writing
    and their running; then the answer."""
    ideal = {"eager": 0.0, "after_reply": 0.0, "one_by_one": 0.0}
    for blocks in script[:-1]:
        done_s, ends = 0.0, []
        for block in blocks:
            done_s += write_s(block)
            ends.append((done_s, block["input"]["ms"] / 1000))
        ideal["eager"] += max(at + run for at, run in ends)
        ideal["after_reply"] += done_s + max(run for _, run in ends)
        ideal["one_by_one"] += done_s + sum(run for _, run in ends)
    answer = sum(write_s(block) for block in script[-1])
    per_request = LATENCY_MS / 1000 * len(script)
    return {k: (v + answer + per_request) * 1000 for k, v in ideal.items()}


def timers(st: Stack, no_eager: Stack, script: list[Any], turns: int) -> dict[str, Timer]:
    prompt = st.script(script, latency_ms=LATENCY_MS, pace_tps=DEFAULT_PACE_TPS)
    return {
        "fleet": partial(time_fleet, st.client, prompt, turns),
        "fleet_no_eager": partial(time_fleet, no_eager.client, prompt, turns),
        **peer_timers(st.fake.url, prompt),
    }


def run(quick: bool) -> Result:
    res = Result(NAME)
    rounds, turns = (1, 2) if quick else (5, len(DURATIONS_MS))
    with ExitStack() as worlds:
        fake = worlds.enter_context(FakeAnthropic())
        st = Stack(fake=fake)
        no_eager = Stack(env={"CMDOP_EAGER_DISPATCH": "false"}, fake=fake)
        open_stacks(worlds, st, no_eager)
        script = conversation(st.machines, turns)
        for warm in timers(st, no_eager, [text(ANSWER)], 0).values():
            warm()
        times = interleaved(timers(st, no_eager, script, turns), rounds)
    ideal = ideal_ms(script)
    inputs = [len(json.dumps(b["input"])) for t in script[:-1] for b in t]
    res.raw = {"ms": times, "ideal_ms": ideal, "turns": turns, "rounds": rounds, "inputs": inputs}
    fleet = times["fleet"]
    res.add(
        f"fleet: {turns} turns x 4 calls (1.5/0.2/0.2/0.05 s), {DEFAULT_PACE_TPS:g} tok/s",
        statistics.median(fleet),
        "ms",
        f"median of {rounds} (min {min(fleet):.0f}, max {max(fleet):.0f}); ideal eager"
        f" {ideal['eager']:.0f}, after the reply {ideal['after_reply']:.0f}",
        f"{statistics.median(fleet) / ideal['eager']:.2f}x ideal",
    )
    add_ratios(res, times, TITLES, targets=TARGETS)
    res.add(
        "  ideal eager / ideal after the reply (the most eagerness can win)",
        ideal["eager"] / ideal["after_reply"],
        "x",
        f"calls' input {min(inputs)}-{max(inputs)} chars; one by one {ideal['one_by_one']:.0f} ms",
    )
    return res
