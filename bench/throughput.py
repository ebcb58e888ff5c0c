"""5. Throughput and scale: many concurrent runs through one fleet.

200 runs (16 with --quick) submitted at once, each 3 turns x 4 `bench_noop` calls then
a final answer, the fake model answering after 50 ms. The fake server runs as its own
process here, so this process (the client side) does not share its GIL.

Configurations: 1 -> 2 -> 4 coordinator processes over 2 machine queues, and 2 -> 20
machine queues with 2 coordinators; every worker runs the product's default
concurrency. One Redis and one fleet serve all configurations: the fleet is grown (or
a coordinator stopped) between them, and finished runs' keys are deleted so each
starts from a small keyspace (presence lookups SCAN it).

A run's time is its submit (wall clock here) -> its terminal event's `ts_ms`; runs/s is
runs / (last terminal event - first submit). Peak memory is each worker process's
VmHWM from /proc. CPU per run: CPU seconds (/proc stat) of every worker, redis-server
and the fake over the batch, divided by runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.common import (
    Result,
    Stack,
    cpu_s,
    peak_rss_mb,
    summary,
    text,
    tool_use,
    wall_ms,
)
from cmdop_worker.models import Event

NAME = "throughput"
TURNS, TOOLS, LATENCY_MS = 3, 4, 50


def scripts(st: Stack) -> list[str]:
    """One script per machine offset, so the calls of many runs cover every queue."""
    names, prompts = st.machines, []
    for offset in range(len(names)):
        turns: list[Any] = [
            [
                tool_use("bench_noop", machine=names[(offset + t * TOOLS + c) % len(names)])
                for c in range(TOOLS)
            ]
            for t in range(TURNS)
        ]
        prompts.append(st.script([*turns, text("done")], latency_ms=LATENCY_MS))
    return prompts


def wait_all(st: Stack, run_ids: list[str], timeout_s: float) -> None:
    keys = st.client.keys
    pending = list(run_ids)
    give_up = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > give_up:
            raise RuntimeError(f"{len(pending)} of {len(run_ids)} runs unfinished")
        found = st.client.redis.mget([keys.result(r) for r in pending])
        pending = [r for r, raw in zip(pending, found, strict=True) if raw is None]
        time.sleep(0.02)


def last_event(st: Stack, run_id: str) -> Event:
    rows = st.client.redis.xrevrange(st.client.keys.events(run_id), count=1)
    return Event.model_validate_json(rows[0][1]["event"])


def resize(st: Stack, coordinators: int, machines: int) -> None:
    """Grow (or shrink) the benchmark's fleet to this many coordinators and machines."""
    names = [f"m{i:02d}" for i in range(machines)]
    for name in names[len(st.pids("machine")) :]:
        st.fleet.start_machine(name)
    running = sorted(n for n in st.fleet.workers if n.startswith("coordinator"))
    for i in range(len(running), coordinators):
        st.fleet.start_coordinator(f"coordinator-{i}")
    for name in running[coordinators:]:
        st.fleet.workers.pop(name).stop()
    st.machines = names
    st.fleet.wait_ready(names, coordinators=coordinators, timeout_s=120)


def clear_runs(st: Stack) -> None:
    """Drop finished runs' keys, so each configuration starts from a small keyspace."""
    pattern = f"{st.client.keys.prefix}run:*"
    batch = list(st.client.redis.scan_iter(match=pattern, count=1000))
    for i in range(0, len(batch), 1000):
        st.client.redis.delete(*batch[i : i + 1000])


def fleet_cpu_s(st: Stack) -> float:
    pids = [w.pid for w in st.fleet.workers.values()]
    return sum(cpu_s(p) for p in [*pids, st.redis.process.pid, st.fake.process.pid])


def one_batch(st: Stack, coordinators: int, runs: int) -> dict[str, Any]:
    prompts = scripts(st)
    # One warm-up run per script: every machine and coordinator has served calls.
    wait_all(st, [st.client.submit(prompt=p).run_id for p in prompts], 120)
    cpu_before = fleet_cpu_s(st)
    submitted: dict[str, float] = {}
    for i in range(runs):
        stamp = wall_ms()
        submitted[st.client.submit(prompt=prompts[i % len(prompts)]).run_id] = stamp
    wait_all(st, list(submitted), 240)
    cpu = fleet_cpu_s(st) - cpu_before
    ends = {r: last_event(st, r) for r in submitted}
    times = [ends[r].ts_ms - submitted[r] for r in submitted]
    span_ms = max(e.ts_ms for e in ends.values()) - min(submitted.values())
    return {
        "coordinators": coordinators,
        "machines": len(st.machines),
        "runs": runs,
        "done": sum(e.type == "DONE" for e in ends.values()),
        "runs_per_s": runs / (span_ms / 1000),
        "run_ms": summary(times),
        "cpu_s_per_run": cpu / runs,
        "peak_rss_mb": {
            "coordinator": [peak_rss_mb(p) for p in st.pids("coordinator")],
            "machine": [peak_rss_mb(p) for p in st.pids("machine")],
        },
    }


def run(quick: bool) -> Result:
    res = Result(NAME)
    runs = 16 if quick else 200
    configs = [(1, 2), (2, 2)] if quick else [(1, 2), (2, 2), (4, 2), (2, 20)]
    measured = []
    with Stack(machines=["m00", "m01"], remote_fake=True) as st:
        for coordinators, machines in configs:
            resize(st, coordinators, machines)
            measured.append(one_batch(st, coordinators, runs))
            clear_runs(st)
    res.raw = {"configs": measured, "turns": TURNS, "tools": TOOLS, "latency_ms": LATENCY_MS}
    base = measured[0]["runs_per_s"]
    for m in measured:
        res.add(
            f"{m['coordinators']} coord x {m['machines']} machines, {runs} runs ({m['done']} DONE)",
            m["runs_per_s"],
            "runs/s",
            f"run p50 {m['run_ms']['p50'] / 1000:.1f} s, p95 {m['run_ms']['p95'] / 1000:.1f} s;"
            f" CPU {m['cpu_s_per_run'] * 1000:.0f} ms/run",
            f"{m['runs_per_s'] / base:.2f}x 1st",
        )
    coord = [x for m in measured for x in m["peak_rss_mb"]["coordinator"]]
    mach = [x for m in measured for x in m["peak_rss_mb"]["machine"]]
    res.add(
        "peak RSS per worker: coordinator (max)",
        max(coord),
        "MB",
        f"machine worker max {max(mach):.0f} MB, median {statistics.median(mach):.0f} MB",
    )
    cpu = statistics.median(m["cpu_s_per_run"] for m in measured)
    res.add(
        "fleet CPU per run (workers + redis + fake), median",
        cpu * 1000,
        "ms",
        f"so 2 cores cap at ~{2 / cpu:.1f} runs/s",
    )
    return res
