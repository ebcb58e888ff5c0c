"""Scale (issue 24): what a large fleet costs, each figure against its aim, in one run.

In phases, each on stacks of its own (a private Redis, the fake model as its own
process, coordinators and machine workers):

1. Two fleets side by side, each with one coordinator and machine workers `m00`, `m01`:
   the small one stays at 2 machines; the big one grows by presences of machines with
   no worker behind them, made the way a worker makes its own (`state.presence.announce`,
   the presence of its real `m00` under another name), to 1,000 then 10,000 (1,000
   only with --quick). At each size, in rounds that take one run on each fleet (which
   goes first alternating, so load drift hits both alike):
   - the request's tool block in bytes (the `tools` array the fake model received);
   - one-turn runs timed from their submit to the model's request arriving (the fake
     records when): the coordinator's whole way from a run's start to the model call.
     First on an unchanged fleet, then with one machine joining before each run (and
     leaving after it), so every run's turn reads a fleet that moved;
   - in this process, one presence read (`fleet_snapshot`) after one machine joined.
2. One fleet, 2 coordinators: the throughput workload (`bench.throughput`'s runs: 3
   turns x 4 `bench_noop` calls, 50 ms model) over 2 -> 20 -> 50 machine workers
   (2 -> 20 with --quick), 100 runs (16) submitted at once at each size. The first 2
   machine workers run the product's default concurrency, every one added the lowest
   the worker takes (1 thread), so no size has fewer slots than the first: what grows
   is processes, queues, connections and presence keys. Memory: the machine workers'
   summed PSS and the largest VmHWM, and the host's MemAvailable at each size.
   Then, at the largest size, batches of half as many runs spread over the first 2
   machine workers and over all of them, interleaved round by round (which goes first
   alternating): the drift-proof view of the same ratio, with every worker online.
3. At 20 machine workers: one `execute_command` `sleep 1` fanned out to every machine
   (`machines: "*"`), timed from the model's first request arriving to its second (the
   results back); "not available" when the fleet's tool block offers no `machines`.
4. An idle machine worker's Redis commands per second (`bench.idle_machine.measure`,
   its own Redis and worker).

Ratios are against the 2-machine figures of the same run.
`python -m bench --only scale` (~4 min on 2 cores; --quick ~1.5 min).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench import idle_machine
from bench.common import Result, Stack, mono_ms, open_stacks, requests_for, text, tool_use
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
    wait_all(st, [run_id], 120)
    (request,) = requests_for(st.fake, prompt.split()[0])
    tools = request["body"].get("tools") or []
    return {
        "ms": request["received_ms"] - started,
        "tool_bytes": len(json.dumps(tools, separators=(",", ":"))),
        "tools": tools,
    }


def joined_turn(st: Stack, like: MachinePresence, name: str) -> dict[str, Any]:
    """A one-turn run with a machine joining just before it (and leaving after)."""
    grow(st, like, [name])
    try:
        return one_turn(st)
    finally:
        leave(st.client.redis, st.client.keys, name)


def read_after_join(st: Stack, like: MachinePresence, size: int, tries: int) -> float:
    """In this process: the presence read after one join, as a coordinator's turn does
    it (median ms)."""
    r, keys = st.client.redis, st.client.keys
    fleet_snapshot(r, keys)
    reads = []
    for i in range(tries):
        grow(st, like, [f"read-{size}-{i}"])
        started = time.perf_counter()
        snapshot = fleet_snapshot(r, keys)
        reads.append((time.perf_counter() - started) * 1000)
        assert len(snapshot.presences) == size + 1, (len(snapshot.presences), size)
        leave(r, keys, f"read-{size}-{i}")
        fleet_snapshot(r, keys)
    return statistics.median(reads)


def rounds(
    small: Stack, big: Stack, tries: int, turn: Callable[[Stack, int], dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`tries` turns on each fleet, one of each per round, which goes first alternating."""
    on_small, on_big = [], []
    for i in range(tries):
        if i % 2 == 0:
            on_small.append(turn(small, i))
            on_big.append(turn(big, i))
        else:
            on_big.append(turn(big, i))
            on_small.append(turn(small, i))
    return on_small, on_big


def at_size(small: Stack, big: Stack, like: MachinePresence, tries: int) -> dict[str, Any]:
    size = len(fleet_snapshot(big.client.redis, big.client.keys).presences)
    one_turn(small)  # warm: each coordinator has read this size's fleet
    one_turn(big)
    still = rounds(small, big, tries, lambda st, i: one_turn(st))
    moved = rounds(small, big, tries, lambda st, i: joined_turn(st, like, f"join-{size}-{i}"))
    return {
        "size": size,
        "tool_bytes": (still[0][0]["tool_bytes"], still[1][0]["tool_bytes"]),
        "same_tools": still[0][0]["tools"] == still[1][0]["tools"],
        "turn_ms": tuple(statistics.median(t["ms"] for t in side) for side in still),
        "turn_after_join_ms": tuple(statistics.median(t["ms"] for t in side) for side in moved),
        "read_after_join_ms": read_after_join(big, like, size, tries),
    }


def presence_phase(sizes: list[int], tries: int) -> list[dict[str, Any]]:
    """Two fleets side by side, 2 machines each and one coordinator: the small one
    stays at 2, the big one grows to each size by announced presences."""
    measured = []
    small = Stack(machines=["m00", "m01"], remote_fake=True)
    big = Stack(machines=["m00", "m01"], remote_fake=True)
    with ExitStack() as worlds:
        open_stacks(worlds, small, big)
        like = template(big)
        made = 2
        for size in sizes:
            grow(big, like, [f"x{i:05d}" for i in range(made - 2, size - 2)])
            made = size
            measured.append(at_size(small, big, like, tries))
    return measured


def add_presence_rows(res: Result, measured: list[dict[str, Any]]) -> None:
    thousand = next((m for m in measured if m["size"] == 1000), measured[0])
    small_bytes, big_bytes = thousand["tool_bytes"]
    ratio = big_bytes / small_bytes
    res.add(
        f"tool block bytes, {thousand['size']:,} online vs 2",
        big_bytes,
        "bytes",
        f"{small_bytes:,} bytes at 2"
        f" ({'byte-identical' if thousand['same_tools'] else 'differs'}); aim <= {AIM_TOOL_BLOCK}x",
        f"{ratio:.2f}x {'ok' if ratio <= AIM_TOOL_BLOCK else 'MISS'}",
    )
    for key, what in (
        ("turn_ms", "unchanged fleet"),
        ("turn_after_join_ms", "a machine joined before each run"),
    ):
        for m in measured:
            small_ms, big_ms = m[key]
            ratio = big_ms / small_ms
            last = m is measured[-1]
            res.add(
                f"submit -> model call, {m['size']:,} online vs 2: {what}",
                big_ms,
                "ms",
                f"2 online {small_ms:.1f} ms, interleaved"
                + (f"; aim <= {AIM_TURN}x" if last else ""),
                f"{ratio:.2f}x" + (f" {'ok' if ratio <= AIM_TURN else 'MISS'}" if last else ""),
            )
    res.add(
        "  presence read after one join (in process)",
        measured[-1]["read_after_join_ms"],
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


def spread_rounds(st: Stack, runs: int, rounds: int) -> dict[str, Any]:
    """At the fleet's full size: batches spread over its first 2 machine workers and
    over all of them, alternating (which goes first too), so load drift hits both
    alike; runs/s of each kind per round."""
    every = list(st.machines)
    found: dict[str, list[float]] = {"two": [], "all": []}
    for i in range(rounds):
        for kind in ("two", "all") if i % 2 == 0 else ("all", "two"):
            st.machines = every[:2] if kind == "two" else every
            found[kind].append(fleet_batch(st, COORDINATORS, runs)["runs_per_s"])
            clear_runs(st)
    st.machines = every
    return {"machines": len(every), "runs": runs, **found}


def tools_of(st: Stack) -> list[dict[str, Any]]:
    """The tool block the fleet's model is offered (from a one-turn run)."""
    tools: list[dict[str, Any]] = one_turn(st)["tools"]
    return tools


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
    presence_sizes = [1000] if quick else [1000, 10_000]
    runs, worker_sizes = (16, [2, 20]) if quick else (100, [2, 20, 50])
    tries = 3 if quick else 8
    fanout_at = 20
    fleet: list[dict[str, Any]] = []
    fanned: dict[str, Any] | None = None
    presence = presence_phase(presence_sizes, tries)
    with Stack(machines=["m00", "m01"], coordinators=COORDINATORS, remote_fake=True) as st:
        for machines in worker_sizes:
            fleet.append(one_size(st, machines, runs))
            if machines == fanout_at and fans_out(tools_of(st)):
                fanned = fan_out(st, 3)
        spread = spread_rounds(st, runs // 2, 2 if quick else 3)
    idle = idle_machine.measure(10 if quick else 20)
    res.raw = {
        "presence": presence,
        "sizes": fleet,
        "fan_out": fanned,
        "spread": spread,
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
    ratios = [a / b for a, b in zip(spread["all"], spread["two"], strict=True)]
    res.add(
        f"  the same fleet of {spread['machines']}: runs spread over all vs over 2 of them",
        statistics.median(ratios),
        "x",
        f"{len(ratios)} interleaved rounds of {spread['runs']} runs each way: per round"
        f" {', '.join(f'{r:.2f}' for r in ratios)}; over all"
        f" {statistics.median(spread['all']):.2f} runs/s, over 2"
        f" {statistics.median(spread['two']):.2f} runs/s",
    )
    add_fan_out_row(res, fanned, fanout_at)
    return res
