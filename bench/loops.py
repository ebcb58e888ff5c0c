"""The agent loops the peer benchmarks (`peers`, `paced`) compare, and how they compare.

Each timer runs one scripted conversation once against the fake server and returns its
milliseconds:

- our fleet: submitted through `Client`, timed submit -> result stored;
- the anthropic SDK's `client.beta.messages.tool_runner` with `thread=False` (its
  default server-side thread sends only new messages, which a stateless fake - and our
  history-is-the-truth design - cannot follow); it runs a turn's tools one by one;
- pydantic-ai's `Agent` with `AnthropicModel` pointed at the fake through
  `AnthropicProvider(base_url=...)`; it runs a turn's tools concurrently.

The peers' tool is `bench_sleep` here, a plain `time.sleep` with the fleet tool's
schema (`bench.tools`; `machine` accepted and ignored), so one script serves every loop
and every loop's model writes the same inputs.

`interleaved` runs the loops round by round so a shared machine's drifting load hits
them alike, the order rotated per round so each loop goes first, second, ... equally
often; `add_ratios` reports medians across rounds and their ratios, with the spread of
the per-round ratios beside them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from functools import partial

from bench.common import MODEL, Result, check
from cmdop_worker.surfaces.client import Client

Timer = Callable[[], float]


def bench_sleep(ms: int, machine: str = "", note: str = "") -> str:
    """Wait `ms` milliseconds."""
    time.sleep(ms / 1000)
    return f"slept {ms} ms"


def time_fleet(client: Client, prompt: str, turns: int) -> float:
    """One run through the fleet; `turns`: the tool turns the script has before its answer."""
    started = time.perf_counter()
    result = client.submit(prompt=prompt, timeout_s=120).wait(timeout=120)
    elapsed = (time.perf_counter() - started) * 1000
    if result.turns != turns + 1:
        raise RuntimeError(f"fleet run ended after {result.turns} turns ({result.stop_reason})")
    return elapsed


def time_tool_runner(url: str, prompt: str) -> float:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="sk-bench-not-a-key", max_retries=0)
    started = time.perf_counter()
    runner = client.beta.messages.tool_runner(
        model=MODEL,
        max_tokens=1024,
        messages=[{"role": "user", "content": prompt}],
        tools=[anthropic.beta_tool(bench_sleep)],
        thread=False,
    )
    final = runner.until_done()
    elapsed = (time.perf_counter() - started) * 1000
    client.close()
    if final.stop_reason != "end_turn":
        raise RuntimeError(f"tool_runner ended with {final.stop_reason}")
    return elapsed


def time_pydantic_ai(url: str, prompt: str, answer: str = "done") -> float:
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    provider = AnthropicProvider(base_url=url, api_key="sk-bench-not-a-key")
    agent = Agent(AnthropicModel(MODEL, provider=provider))
    agent.tool_plain(bench_sleep)
    started = time.perf_counter()
    output = agent.run_sync(prompt).output
    elapsed = (time.perf_counter() - started) * 1000
    if output != answer:
        raise RuntimeError(f"pydantic-ai answered {output!r}")
    return elapsed


def peer_timers(url: str, prompt: str) -> dict[str, Timer]:
    """The in-process loops, each on the conversation `prompt` selects."""
    import pydantic_ai.models.anthropic  # noqa: F401  (imports are not the loop's time)

    return {
        "tool_runner": partial(time_tool_runner, url, prompt),
        "pydantic_ai": partial(time_pydantic_ai, url, prompt),
    }


def rotated(names: tuple[str, ...], n: int) -> tuple[str, ...]:
    """Round n's order: the loops rotated by n."""
    k = n % len(names)
    return names[k:] + names[:k]


def interleaved(timers: Mapping[str, Timer], rounds: int) -> dict[str, list[float]]:
    """Each loop's times, `rounds` rounds each running every loop once (`rotated`)."""
    names = tuple(timers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for n in range(rounds):
        for name in rotated(names, n):
            times[name].append(timers[name]())
    return times


def add_ratios(
    res: Result,
    times: Mapping[str, list[float]],
    titles: Mapping[str, str],
    *,
    base: str = "fleet",
    targets: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """A row per loop in `titles`: its median and `base`'s median over it (with a
    verdict against its target, if any). Returns those ratios by loop."""
    ours = times[base]
    ratios = {}
    for name, title in titles.items():
        ratio = statistics.median(ours) / statistics.median(times[name])
        per_round = [f / p for f, p in zip(ours, times[name], strict=True)]
        limit = (targets or {}).get(name)
        goal = "" if limit is None else f"; target <= {limit}"
        res.add(
            f"  {title}",
            statistics.median(times[name]),
            "ms",
            f"{base} / this, medians; per round {min(per_round):.2f}-{max(per_round):.2f}x{goal}",
            f"{ratio:.2f}x" + ("" if limit is None else f" {check(ratio, limit)}"),
        )
        ratios[name] = ratio
    return ratios
