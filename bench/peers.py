"""3. Peers: one scripted conversation, run by our fleet and by two in-process loops.

5 turns of 4 tool calls, each tool a 200 ms wait, then a final answer; the fake model
answers every request after 50 ms. The same fake server serves all three:

- our fleet: `bench_sleep` on 2 machine workers (2 calls each per turn), submitted
  through `Client`, timed submit -> result stored;
- the anthropic SDK's `client.beta.messages.tool_runner` with `thread=False` (its
  default server-side thread sends only new messages, which a stateless fake - and our
  history-is-the-truth design - cannot follow); it runs a turn's tools one by one;
- pydantic-ai's `Agent` with `AnthropicModel` pointed at the fake through
  `AnthropicProvider(base_url=...)`; it runs a turn's tools concurrently.

Peers use a plain `time.sleep(0.2)` tool with the same schema minus `machine`.
Ideal (tools in parallel, zero overhead): 5 x (200 + 50) + 50 = 1300 ms.

After one untimed 1-turn warm-up of each loop, the three are interleaved so a shared
machine's drifting load hits them alike: 6 rounds (3 with --quick, of 2 turns), each
running all three once, the order rotated per round so each loop goes first, second
and third equally often. Reported times are medians across rounds, and the ratios are
of those medians; the spread of the per-round ratios is shown beside them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.common import MODEL, Result, Stack, spread, text, tool_use

NAME = "peers"
TURNS, TOOLS, TOOL_MS, LATENCY_MS = 5, 4, 200, 50
QUICK_TURNS = 2
LOOPS = ("fleet", "tool_runner", "pydantic_ai")
TITLES = {"tool_runner": "anthropic tool_runner", "pydantic_ai": "pydantic-ai"}


def ideal_ms(turns: int) -> int:
    return turns * (TOOL_MS + LATENCY_MS) + LATENCY_MS


def conversation(machines: list[str] | None, turns: int) -> dict[str, Any]:
    def call(machine: str | None) -> dict[str, Any]:
        args: dict[str, Any] = {"ms": TOOL_MS}
        if machine is not None:
            args["machine"] = machine
        return tool_use("bench_sleep", **args)

    def one_turn() -> list[Any]:
        return spread(machines, TOOLS, call) if machines else [call(None) for _ in range(TOOLS)]

    script = [one_turn() for _ in range(turns)] + [text("done")]
    return {"turns": script, "latency_ms": LATENCY_MS}


def time_fleet(st: Stack, turns: int) -> float:
    script = conversation(st.machines, turns)
    prompt = st.script(script["turns"], latency_ms=LATENCY_MS)
    started = time.perf_counter()
    result = st.client.submit(prompt=prompt, timeout_s=60).wait(timeout=60)
    elapsed = (time.perf_counter() - started) * 1000
    if result.turns != turns + 1:
        raise RuntimeError(f"fleet run ended after {result.turns} turns")
    return elapsed


def time_tool_runner(url: str, prompt: str) -> float:
    import anthropic

    @anthropic.beta_tool
    def bench_sleep(ms: int) -> str:
        """Wait `ms` milliseconds."""
        time.sleep(ms / 1000)
        return f"slept {ms} ms"

    client = anthropic.Anthropic(base_url=url, api_key="sk-bench-not-a-key", max_retries=0)
    started = time.perf_counter()
    runner = client.beta.messages.tool_runner(
        model=MODEL,
        max_tokens=1024,
        messages=[{"role": "user", "content": prompt}],
        tools=[bench_sleep],
        thread=False,
    )
    final = runner.until_done()
    elapsed = (time.perf_counter() - started) * 1000
    client.close()
    if final.stop_reason != "end_turn":
        raise RuntimeError(f"tool_runner ended with {final.stop_reason}")
    return elapsed


def time_pydantic_ai(url: str, prompt: str) -> float:
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    provider = AnthropicProvider(base_url=url, api_key="sk-bench-not-a-key")
    agent = Agent(AnthropicModel(MODEL, provider=provider))

    @agent.tool_plain
    def bench_sleep(ms: int) -> str:
        """Wait `ms` milliseconds."""
        time.sleep(ms / 1000)
        return f"slept {ms} ms"

    started = time.perf_counter()
    output = agent.run_sync(prompt).output
    elapsed = (time.perf_counter() - started) * 1000
    if output != "done":
        raise RuntimeError(f"pydantic-ai answered {output!r}")
    return elapsed


def timers(st: Stack, turns: int) -> dict[str, Callable[[], float]]:
    """Per loop, a call that runs the `turns`-turn conversation once and returns its ms."""
    peer = conversation(None, turns)
    prompt = st.script(peer["turns"], latency_ms=LATENCY_MS)
    return {
        "fleet": lambda: time_fleet(st, turns),
        "tool_runner": lambda: time_tool_runner(st.fake.url, prompt),
        "pydantic_ai": lambda: time_pydantic_ai(st.fake.url, prompt),
    }


def order(n: int) -> tuple[str, ...]:
    """Round n's order: the loops rotated by n."""
    k = n % len(LOOPS)
    return LOOPS[k:] + LOOPS[:k]


def run(quick: bool) -> Result:
    res = Result(NAME)
    rounds, turns = (3, QUICK_TURNS) if quick else (6, TURNS)
    times: dict[str, list[float]] = {name: [] for name in LOOPS}
    with Stack(env={"CMDOP_WORKER_CONCURRENCY": "8"}) as st:
        import pydantic_ai.models.anthropic  # noqa: F401  (imports are not the loop's time)

        for warm in timers(st, 1).values():  # lazy clients, connection pools
            warm()
        timed = timers(st, turns)
        for n in range(rounds):
            for name in order(n):
                times[name].append(timed[name]())
    median = {name: statistics.median(values) for name, values in times.items()}
    ideal = ideal_ms(turns)
    res.raw = {
        "ms": times,
        "orders": [order(n) for n in range(rounds)],
        "ideal_ms": ideal,
        "turns": turns,
    }
    fleet = times["fleet"]
    res.add(
        f"fleet: {turns} turns x {TOOLS} parallel {TOOL_MS} ms tools, {LATENCY_MS} ms model",
        median["fleet"],
        "ms",
        f"median of {rounds} rounds (min {min(fleet):.0f}, max {max(fleet):.0f}); ideal {ideal}",
        f"{median['fleet'] / ideal:.2f}x ideal",
    )
    for name, title in TITLES.items():
        per_round = [f / p for f, p in zip(fleet, times[name], strict=True)]
        res.add(
            f"  {title} (in-process)",
            median[name],
            "ms",
            f"fleet / peer, medians; per round {min(per_round):.2f}-{max(per_round):.2f}x",
            f"{median['fleet'] / median[name]:.2f}x",
        )
    return res
