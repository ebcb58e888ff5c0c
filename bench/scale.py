"""Scale: the throughput workload over 2 -> 10 -> 50 machine workers (2 -> 20, --quick).

`throughput`'s runs (3 turns x 4 `bench_noop` calls, 50 ms model, calls spread over
every machine queue), 200 of them (16 with --quick) submitted at once, 2 coordinators;
every worker is its own process, each machine worker on its own queue. The first 2
machine workers run the product's default concurrency (16 threads), as a 2-machine
fleet would; every one added runs the lowest the worker takes (`CMDOP_WORKER_CONCURRENCY=1`,
threads pool), so 50 fit a 2-core box. No configuration has fewer slots than the first
(at c=1, 2 workers would be slot-bound and flatter the ratio): what grows is
processes, queues, connections and presence keys. One fleet is grown between
configurations (`throughput.resize`), finished runs' keys dropped in between.

Reported per configuration: runs/s and its ratio to the 2-machine one (aim: at most
20% lower at 50), p50/p95 run time, and memory: the machine workers' summed PSS
(shared pages counted once, from /proc/<pid>/smaps_rollup) and the largest VmHWM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import Result, Stack
from bench.throughput import clear_runs, fleet_batch, resize

NAME = "scale"
COORDINATORS = 2
ONE_SLOT = {"CMDOP_WORKER_CONCURRENCY": "1"}
AIM_DROP = 0.8  # runs/s at the most machines over runs/s at 2


def pss_mb(pid: int) -> float:
    """The process's proportional set size in MB (shared pages split among sharers)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_size(st: Stack, machines: int, runs: int) -> dict[str, Any]:
    resize(st, COORDINATORS, machines, ONE_SLOT)
    batch = fleet_batch(st, COORDINATORS, runs)
    batch["machine_pss_mb"] = sum(pss_mb(p) for p in st.pids("machine"))
    clear_runs(st)
    return batch


def run(quick: bool) -> Result:
    res = Result(NAME)
    runs, sizes = (16, [2, 20]) if quick else (200, [2, 10, 50])
    first = [f"m{i:02d}" for i in range(sizes[0])]
    with Stack(machines=first, coordinators=COORDINATORS, remote_fake=True) as st:
        measured = [one_size(st, machines, runs) for machines in sizes]
    res.raw = {"sizes": measured, "coordinators": COORDINATORS, "runs": runs}
    base = measured[0]["runs_per_s"]
    for m in measured:
        ratio = m["runs_per_s"] / base
        last = m is measured[-1]
        res.add(
            f"{m['machines']} machine workers, {COORDINATORS} coord, {runs} runs"
            f" ({m['done']} DONE)",
            m["runs_per_s"],
            "runs/s",
            f"run p50 {m['run_ms']['p50'] / 1000:.2f} s, p95 {m['run_ms']['p95'] / 1000:.2f} s;"
            f" machines' PSS {m['machine_pss_mb']:,.0f} MB, max VmHWM"
            f" {max(m['peak_rss_mb']['machine']):.0f} MB"
            + (f"; aim >= {AIM_DROP}x" if last and len(measured) > 1 else ""),
            f"{ratio:.2f}x {sizes[0]}"
            + (f" {'ok' if ratio >= AIM_DROP else 'MISS'}" if last else ""),
        )
    p95 = [m["run_ms"]["p95"] for m in measured]
    res.add(
        f"  p95 run time at {sizes[-1]} over at {sizes[0]} machine workers",
        p95[-1] / p95[0],
        "x",
        " -> ".join(f"{x / 1000:.2f} s" for x in p95),
    )
    return res
