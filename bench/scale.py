"""Scale (issue 24): what a large fleet costs, each figure against its aim, in one run.

One stack (a private Redis, the fake model as its own process, 2 coordinators, machine
workers `m00`, `m01`), in phases:

1. Presences of machines with no worker behind them, made the way a worker makes its
   own (`state.presence.announce`, the presence of the real `m00` under another name):
   2 online (the real ones), then 1,000, then 10,000 (1,000 with --quick). At each size:
   - the request's tool block in bytes (the `tools` array the fake model received);
   - one-turn runs, each timed from its submit to the model's request arriving (the
     fake records when): the coordinator's whole way from a run's start to the model
     call. First on an unchanged fleet, then with one machine joining before each run
     (and leaving after it), so every run's turn reads a fleet that moved;
   - in this process, one presence read (`fleet_snapshot`) after one machine joined.
   The extra presences leave again (`leave`) before phase 2.
2. The throughput workload (`bench.throughput`'s runs: 3 turns x 4 `bench_noop` calls,
   50 ms model) over 2 -> 20 -> 50 machine workers (2 -> 20 with --quick), RUNS runs
   submitted at once at each size. The first 2 machine workers run the product's default
   concurrency, every one added the lowest the worker takes (1 thread), so no size has
   fewer slots than the first: what grows is processes, queues, connections and
   presence keys. Memory: the machine workers' summed PSS and the largest VmHWM, and the
   host's MemAvailable at the largest size.
3. At 20 machine workers: one `execute_command` `sleep 1` fanned out to every machine
   (`machines: "*"`), timed from the model's first request arriving to its second (the
   results back); "not available" when the fleet's tool block offers no `machines`.
4. An idle machine worker's Redis commands per second (`bench.idle_machine.measure`,
   its own Redis and worker).

Ratios are against the 2-machine figures of the same run.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench import idle_machine
from bench.common import Result, Stack, mono_ms, requests_for, text, tool_use
from bench.throughput import clear_runs, fleet_batch, resize, wait_all
from cmdop_worker.models import MachinePresence
from cmdop_worker.state.presence import announce, fleet_snapshot, leave, parse_presence

NAME = "scale"
COORDINATORS = 2
ONE_SLOT = {"CMDOP_WORKER_CONCURRENCY": "1"}
FAKE_TTL_MS = 3_600_000  # the extra presences outlive the benchmark; they leave at its end
AIM_TOOL_BLOCK = 1.1  # tool block bytes at 1,000 over at 2
AIM_TURN = 1.5  # submit -> model call at 10,000 over at 2
AIM_FANOUT_S = 1.3
AIM_IDLE = 2.0  # commands a second
AIM_RUNS = 0.8  # runs/s at the most machines over at 2


def pss_mb(pid: int) -> float:
    """The process's proportional set size in MB (shared pages split among sharers)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --- phase 1: presences ------------------------------------------------------------------


def template(st: Stack) -> MachinePresence:
    raw = st.client.redis.get(st.client.keys.machine("m00"))
    found = parse_presence(raw, source="m00") if raw is not None else None
    assert found is not None, "m00 has no readable presence"
    return found


def grow(st: Stack, like: MachinePresence, names: list[str]) -> None:
    for name in names:
        announce(
            st.client.redis,
            st.client.keys,
            like.model_copy(update={"machine": name}),
            ttl_ms=FAKE_TTL_MS,
        )


def one_turn(st: Stack) -> dict[str, Any]:
    """A one-turn run: submit -> the model's request arriving (ms), and its tool block."""
    prompt = st.script([text("done")])
    started = mono_ms()
    run_id = st.client.submit(prompt=prompt).run_id
    wait_all(st, [run_id], 60)
    (request,) = requests_for(st.fake, prompt.split()[0])
    tools = request["body"].get("tools") or []
    return {
        "ms": request["received_ms"] - started,
        "tool_bytes": len(json.dumps(tools, separators=(",", ":"))),
        "tools": tools,
    }


def at_size(st: Stack, like: MachinePresence, size: int, tries: int) -> dict[str, Any]:
    one_turn(st)  # warm: this size's fleet read once by a coordinator
    unchanged = [one_turn(st) for _ in range(tries)]
    changed = []
    for i in range(tries):
        name = f"join-{size}-{i}"
        grow(st, like, [name])
        changed.append(one_turn(st))
        leave(st.client.redis, st.client.keys, name)
    # In this process: the read after one join, as a coordinator's turn does it.
    fleet_snapshot(st.client.redis, st.client.keys)
    reads = []
    for i in range(tries):
        name = f"read-{size}-{i}"
        grow(st, like, [name])
        started = time.perf_counter()
        snapshot = fleet_snapshot(st.client.redis, st.client.keys)
        reads.append((time.perf_counter() - started) * 1000)
        assert len(snapshot.presences) == size + 1, (len(snapshot.presences), size)
        leave(st.client.redis, st.client.keys, name)
        fleet_snapshot(st.client.redis, st.client.keys)
    return {
        "size": size,
        "tool_bytes": unchanged[0]["tool_bytes"],
        "tools": unchanged[0]["tools"],
        "turn_ms": statistics.median(t["ms"] for t in unchanged),
        "turn_after_join_ms": statistics.median(t["ms"] for t in changed),
        "read_after_join_ms": statistics.median(reads),
    }


def presence_phase(st: Stack, sizes: list[int], tries: int) -> list[dict[str, Any]]:
    like = template(st)
    measured, made = [], 2
    extra: list[str] = []
    for size in sizes:
        names = [f"x{i:05d}" for i in range(made - 2, size - 2)]
        grow(st, like, names)
        extra += names
        made = size
        measured.append(at_size(st, like, size, tries))
    for name in extra:
        leave(st.client.redis, st.client.keys, name)
    return measured


def add_presence_rows(res: Result, measured: list[dict[str, Any]]) -> None:
    base, big = measured[0], measured[-1]
    thousand = next((m for m in measured if m["size"] == 1000), big)
    same = thousand["tools"] == base["tools"]
    ratio = thousand["tool_bytes"] / base["tool_bytes"]
    res.add(
        f"tool block bytes, {thousand['size']:,} online vs {base['size']}",
        thousand["tool_bytes"],
        "bytes",
        f"{base['tool_bytes']:,} bytes at {base['size']}"
        f" ({'byte-identical' if same else 'differs'}); aim <= {AIM_TOOL_BLOCK}x",
        f"{ratio:.2f}x {'ok' if ratio <= AIM_TOOL_BLOCK else 'MISS'}",
    )
    for key, what in (
        ("turn_ms", "unchanged fleet"),
        ("turn_after_join_ms", "a machine joined before each run"),
    ):
        ratio = big[key] / base[key]
        res.add(
            f"submit -> model call, {big['size']:,} online vs {base['size']}: {what}",
            big[key],
            "ms",
            " ".join(f"{m['size']:,}: {m[key]:.1f} ms;" for m in measured) + f" aim <= {AIM_TURN}x",
            f"{ratio:.2f}x {'ok' if ratio <= AIM_TURN else 'MISS'}",
        )
    res.add(
        f"  presence read after one join, {big['size']:,} online (in process)",
        big["read_after_join_ms"],
        "ms",
        " ".join(f"{m['size']:,}: {m['read_after_join_ms']:.2f} ms;" for m in measured),
    )


# --- phase 2 and 3: real machine workers ----------------------------------------------


def one_size(st: Stack, machines: int, runs: int) -> dict[str, Any]:
    resize(st, COORDINATORS, machines, ONE_SLOT)
    batch = fleet_batch(st, COORDINATORS, runs)
    batch["machine_pss_mb"] = sum(pss_mb(p) for p in st.pids("machine"))
    batch["mem_available_mb"] = mem_available_mb()
    clear_runs(st)
    return batch


def fans_out(tools: list[dict[str, Any]]) -> bool:
    for spec in tools:
        if spec.get("name") == "execute_command":
            return "machines" in (spec.get("input_schema") or {}).get("properties", {})
    return False


def fan_out(st: Stack, tries: int) -> dict[str, Any]:
    """`sleep 1` on every machine in one call: the model's first request arriving -> its
    second (every copy's result back), per try; and the copies that ended."""
    walls, ended = [], []
    for _ in range(tries):
        call = tool_use("execute_command", machines="*", command="sleep 1", timeout_ms=30_000)
        prompt = st.script([[call], text("done")])
        run_id = st.client.submit(prompt=prompt).run_id
        wait_all(st, [run_id], 120)
        first, second = requests_for(st.fake, prompt.split()[0])[:2]
        walls.append((second["received_ms"] - first["received_ms"]) / 1000)
        ended.append(sum(e.type == "TOOL_END" for e in st.events(run_id)))
    return {"wall_s": statistics.median(walls), "walls_s": walls, "tool_ends": ended}


def add_fleet_rows(res: Result, measured: list[dict[str, Any]], runs: int) -> None:
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
            f" {max(m['peak_rss_mb']['machine']):.0f} MB, host MemAvailable"
            f" {m['mem_available_mb']:,.0f} MB"
            + (f"; aim >= {AIM_RUNS}x" if last and len(measured) > 1 else ""),
            f"{ratio:.2f}x {measured[0]['machines']}"
            + (f" {'ok' if ratio >= AIM_RUNS else 'MISS'}" if last else ""),
        )


def add_fan_out_row(res: Result, found: dict[str, Any] | None, machines: int) -> None:
    title = f"one `sleep 1` fanned out to {machines} machine workers, wall"
    if found is None:
        res.add(title, float("nan"), "s", "not available: no `machines` argument in the tools")
        return
    res.add(
        title,
        found["wall_s"],
        "s",
        f"tries {', '.join(f'{w:.2f}' for w in found['walls_s'])} s; TOOL_END events"
        f" {found['tool_ends']}; aim <= {AIM_FANOUT_S} s",
        "ok" if found["wall_s"] <= AIM_FANOUT_S else "MISS",
    )


def run(quick: bool) -> Result:
    res = Result(NAME)
    presence_sizes = [2, 1000] if quick else [2, 1000, 10_000]
    runs, worker_sizes = (16, [2, 20]) if quick else (100, [2, 20, 50])
    tries = 3 if quick else 6
    fanout_at = 20
    fleet: list[dict[str, Any]] = []
    fanned: dict[str, Any] | None = None
    with Stack(machines=["m00", "m01"], coordinators=COORDINATORS, remote_fake=True) as st:
        presence = presence_phase(st, presence_sizes, tries)
        for machines in worker_sizes:
            fleet.append(one_size(st, machines, runs))
            if machines == fanout_at and fans_out(presence[0]["tools"]):
                fanned = fan_out(st, 3)
    idle = idle_machine.measure(10 if quick else 20)
    res.raw = {
        "presence": [{k: v for k, v in m.items() if k != "tools"} for m in presence],
        "sizes": fleet,
        "fan_out": fanned,
        "idle_machine": idle,
        "coordinators": COORDINATORS,
        "runs": runs,
    }
    add_presence_rows(res, presence)
    res.add(
        "idle machine worker, Redis commands a second",
        idle["ran_per_s"],
        "/s",
        f"over {idle['window_s']:.0f} s, Celery's polling included: {idle['ran']};"
        f" aim <= {AIM_IDLE}",
        "ok" if idle["ran_per_s"] <= AIM_IDLE else "MISS",
    )
    add_fleet_rows(res, fleet, runs)
    add_fan_out_row(res, fanned, fanout_at)
    return res
