"""5. Throughput: many concurrent runs through one fleet, against bare Celery's bound.

200 runs (16 with --quick) submitted at once, each 3 turns x 4 `bench_noop` calls then
a final answer, the fake model answering after 50 ms. The fake server runs as its own
process here, so this process (the client side) does not share its GIL.

Configurations: 1 -> 2 -> 4 coordinator processes (1 -> 2 with --quick) over 2 machine
queues, every worker at the product's default concurrency (machine workers' scale:
`bench.scale`). One Redis and one fleet serve all configurations: the fleet is grown
(or a coordinator stopped) between them, and finished runs' keys are deleted so each
starts from a small keyspace (presence lookups SCAN it).

The bound, per configuration and in the same run: `bench.bare_loop`, the same number
of runs of the same 17 Celery tasks each (run, 4 turns, 12 tool calls), published the
same way, on the same Redis, to as many queues and workers with the same pool and
concurrency, every task a no-op but for handing on; its docstring says why the fleet
cannot beat it. The fleet's runs/s over the bound's is the verdict (target >= 0.6);
which of the two goes first alternates per configuration.

A run's time is its submit (wall clock here) -> its terminal event's `ts_ms` (a bare
run's: its last task's stamp); runs/s is runs / (last end - first submit). Peak memory
is each worker process's VmHWM from /proc. CPU: /proc stat seconds over the batch of
each role (coordinators, machine workers, redis-server, the fake), per run; per task
against a bare task's, per tool call against a bare tool task's, per coordinator task
against a bare run or turn task's (medians over the configurations).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.bare_loop import BareLoop
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
from cmdop_worker.config import Settings
from cmdop_worker.models import Event

NAME = "throughput"
TURNS, TOOLS, LATENCY_MS = 3, 4, 50
TASKS = (
    1 + (TURNS + 1) + TURNS * TOOLS
)  # a run's Celery tasks: run, turns (the answer's too), tools
TARGET_OF_BOUND = 0.6


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


def resize(
    st: Stack, coordinators: int, machines: int, machine_env: dict[str, str] | None = None
) -> None:
    """Grow (or shrink) the benchmark's fleet to this many coordinators and machines;
    new machine workers get `machine_env`."""
    names = [f"m{i:02d}" for i in range(machines)]
    for name in names[len(st.pids("machine")) :]:
        st.fleet.start_machine(name, machine_env)
    running = sorted(n for n in st.fleet.workers if n.startswith("coordinator"))
    for i in range(len(running), coordinators):
        st.fleet.start_coordinator(f"coordinator-{i}")
    for name in running[coordinators:]:
        st.fleet.workers.pop(name).stop()
    st.machines = names
    st.fleet.wait_ready(names, coordinators=coordinators, timeout_s=240)


def clear_runs(st: Stack) -> None:
    """Drop finished runs' keys, so each configuration starts from a small keyspace."""
    pattern = f"{st.client.keys.prefix}run:*"
    batch = list(st.client.redis.scan_iter(match=pattern, count=1000))
    for i in range(0, len(batch), 1000):
        st.client.redis.delete(*batch[i : i + 1000])


def redis_pid(st: Stack) -> int:
    assert st.redis.process is not None
    return st.redis.process.pid


def role_cpu_s(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far, summed per role."""
    return {role: sum(cpu_s(p) for p in found) for role, found in pids.items()}


def measured(
    kind: str,
    coordinators: int,
    spans: dict[str, tuple[float, float]],
    cpu_before: dict[str, float],
    cpu_after: dict[str, float],
) -> dict[str, Any]:
    """A batch's figures from each run's (submitted, ended) wall ms and CPU per role."""
    runs = len(spans)
    span_ms = max(end for _, end in spans.values()) - min(start for start, _ in spans.values())
    return {
        "kind": kind,
        "coordinators": coordinators,
        "runs": runs,
        "runs_per_s": runs / (span_ms / 1000),
        "run_ms": summary([end - start for start, end in spans.values()]),
        "cpu_ms_per_run": {
            role: (cpu_after[role] - cpu_before[role]) * 1000 / runs for role in cpu_before
        },
    }


def fleet_batch(st: Stack, coordinators: int, runs: int) -> dict[str, Any]:
    prompts = scripts(st)
    # One warm-up run per script: every machine and coordinator has served calls.
    wait_all(st, [st.client.submit(prompt=p).run_id for p in prompts], 120)
    pids = {"coordinator": st.pids("coordinator"), "machine": st.pids("machine")}
    pids.update(redis=[redis_pid(st)], fake=[st.fake.process.pid])
    before = role_cpu_s(pids)
    submitted: dict[str, float] = {}
    for i in range(runs):
        stamp = wall_ms()
        submitted[st.client.submit(prompt=prompts[i % len(prompts)]).run_id] = stamp
    wait_all(st, list(submitted), 240)
    after = role_cpu_s(pids)
    ends = {r: last_event(st, r) for r in submitted}
    spans = {r: (submitted[r], float(ends[r].ts_ms)) for r in submitted}
    result = measured("fleet", coordinators, spans, before, after)
    result["machines"] = len(st.machines)
    result["done"] = sum(e.type == "DONE" for e in ends.values())
    result["peak_rss_mb"] = {
        "coordinator": [peak_rss_mb(p) for p in st.pids("coordinator")],
        "machine": [peak_rss_mb(p) for p in st.pids("machine")],
    }
    return result


def bare_batch(bare: BareLoop, st: Stack, coordinators: int, runs: int) -> dict[str, Any]:
    bare.resize(coordinators, st.machines)
    pids = {**bare.pids(), "redis": [redis_pid(st)]}
    before = role_cpu_s(pids)
    spans = bare.batch(runs, turns=TURNS, tools=TOOLS)
    return measured("bare", coordinators, spans, before, role_cpu_s(pids))


def both_batches(
    st: Stack, bare: BareLoop, coordinators: int, runs: int, fleet_first: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fleet's batch and the bare bound's, in the order given."""
    if fleet_first:
        fleet = fleet_batch(st, coordinators, runs)
        return fleet, bare_batch(bare, st, coordinators, runs)
    baseline = bare_batch(bare, st, coordinators, runs)
    return fleet_batch(st, coordinators, runs), baseline


def add_cpu_row(res: Result, title: str, fleet_ms: float, bare_ms: float, vs: str) -> None:
    res.add(title, fleet_ms, "ms", f"bare {bare_ms:.2f} ms{vs}", f"{fleet_ms / bare_ms:.2f}x bare")


def add_cpu_rows(res: Result, pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """CPU per task, tool call and coordinator task: medians over the configurations."""

    def per_run(role: str, kind: int) -> float:
        return statistics.median(pair[kind]["cpu_ms_per_run"].get(role, 0.0) for pair in pairs)

    fleet = sum(per_run(role, 0) for role in ("coordinator", "machine", "redis", "fake"))
    bare = sum(per_run(role, 1) for role in ("coordinator", "machine", "redis"))
    add_cpu_row(
        res,
        f"fleet CPU per task ({TASKS} a run; workers + redis + fake)",
        fleet / TASKS,
        bare / TASKS,
        f" (workers + redis); fleet {fleet:.0f} ms a run: 2 cores cap at {2000 / fleet:.1f} runs/s",
    )
    calls, hops = TURNS * TOOLS, TASKS - TURNS * TOOLS
    add_cpu_row(
        res,
        "  machine workers' CPU per tool call",
        per_run("machine", 0) / calls,
        per_run("machine", 1) / calls,
        " per bare.tool",
    )
    add_cpu_row(
        res,
        f"  coordinators' CPU per run or turn task ({hops} a run)",
        per_run("coordinator", 0) / hops,
        per_run("coordinator", 1) / hops,
        f" per bare.run or bare.turn; fake model {per_run('fake', 0):.0f} ms a run",
    )
    add_cpu_row(res, "  redis CPU per run", per_run("redis", 0), per_run("redis", 1), "")


def run(quick: bool) -> Result:
    res = Result(NAME)
    runs = 16 if quick else 200
    configs = [1, 2] if quick else [1, 2, 4]
    pairs = []
    with Stack(machines=["m00", "m01"], remote_fake=True) as st:
        bare = BareLoop(st.redis.url, Settings().worker_concurrency, st.fleet.logdir / "bare")
        try:
            for n, coordinators in enumerate(configs):
                resize(st, coordinators, 2)
                pairs.append(both_batches(st, bare, coordinators, runs, fleet_first=n % 2 == 0))
                clear_runs(st)
        finally:
            bare.close()
    res.raw = {"configs": pairs, "turns": TURNS, "tools": TOOLS, "latency_ms": LATENCY_MS}
    first = pairs[0][0]["runs_per_s"]
    for fleet, baseline in pairs:
        ratio = fleet["runs_per_s"] / baseline["runs_per_s"]
        res.add(
            f"{fleet['coordinators']} coord x {fleet['machines']} machines, {runs} runs"
            f" ({fleet['done']} DONE)",
            fleet["runs_per_s"],
            "runs/s",
            f"bare Celery bound {baseline['runs_per_s']:.1f} runs/s; run p50"
            f" {fleet['run_ms']['p50'] / 1000:.1f} s, p95 {fleet['run_ms']['p95'] / 1000:.1f} s;"
            f" {fleet['runs_per_s'] / first:.2f}x 1st",
            f"{ratio:.3g}x bound {'ok' if ratio >= TARGET_OF_BOUND else 'MISS'}",
        )
    add_memory_row(res, [fleet for fleet, _ in pairs])
    add_cpu_rows(res, pairs)
    return res


def add_memory_row(res: Result, batches: list[dict[str, Any]]) -> None:
    coord = [x for m in batches for x in m["peak_rss_mb"]["coordinator"]]
    mach = [x for m in batches for x in m["peak_rss_mb"]["machine"]]
    res.add(
        "peak RSS per worker: coordinator (max)",
        max(coord),
        "MB",
        f"machine worker max {max(mach):.0f} MB, median {statistics.median(mach):.0f} MB",
    )
