"""What a call's bounds and the floor's mounts add to a sandboxed call (`sandbox`).

The same command in the same sandbox, with and without `[sandbox.limits]` held (the
call's own cgroup, its rlimits, a sized /tmp) and the floor's paths mounted over, in
interleaved rounds. Reported: p50 and p95 of each, and the extra at p50.
"""

from __future__ import annotations

import dataclasses
import time

from bench.common import Result, pct
from cmdop_worker.machine.bounds import open_bounds
from cmdop_worker.machine.floor_mounts import make_blank
from cmdop_worker.machine.limits import Limits
from cmdop_worker.machine.process import run_command
from cmdop_worker.machine.sandbox import Confinement

COMMAND = "true"


def report(res: Result, jail: Confinement, cwd: str, rounds: int) -> None:
    assert jail.bwrap is not None
    bounds = open_bounds(Limits(), jail.bwrap, None)
    bounded = dataclasses.replace(jail, bounds=bounds, blank=make_blank())
    plain_ms: list[float] = []
    bounded_ms: list[float] = []
    for i in range(rounds):
        pair = [(plain_ms, jail), (bounded_ms, bounded)]
        for samples, confinement in pair if i % 2 == 0 else pair[::-1]:
            started = time.perf_counter()
            run_command(COMMAND, timeout_s=10, cwd=cwd, jail=confinement)
            samples.append((time.perf_counter() - started) * 1000)
    res.raw["bounds"] = {"sandboxed_ms": plain_ms, "bounded_ms": bounded_ms}
    res.add(
        f"`{COMMAND}`: limits and floor mounts extra per call, p50",
        pct(bounded_ms, 50) - pct(plain_ms, 50),
        "ms",
        f"bounded p50 {pct(bounded_ms, 50):.2f} / p95 {pct(bounded_ms, 95):.2f} ms vs "
        f"sandboxed {pct(plain_ms, 50):.2f} / {pct(plain_ms, 95):.2f} ms, {rounds} rounds; "
        f"{bounds.summary}",
    )
