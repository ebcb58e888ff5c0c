"""Profile: where the fleet path spends its time, under the throughput workload.

One coordinator, 2 machines, the fake server as its own process; 40 runs (10 with
--quick) of 3 turns x 4 `bench_noop` calls + a final answer, 50 ms model. For the
whole batch, `py-spy record --gil --nonblocking` samples the coordinator and one
machine worker (only the thread holding the GIL, so this is Python CPU, not waiting);
shares are of those samples, by what is on the stack (a sample counts in every bucket
whose function it is inside). Also measured over the batch: CPU seconds of every
process (/proc stat) per model turn and per tool call, and Redis commands per turn
(INFO commandstats). Last, the cost of one `online_machines` call (it was a SCAN of the
whole keyspace; it reads a name set now) against the keyspace the batch left behind,
and again with 50,000 more keys.

py-spy comes with the `bench` extra; without it the profile rows are skipped. With
`CMDOP_BENCH_PROFILE_DIR` set, the raw profiles (`coordinator.txt`, `machine.txt`, py-spy's
collapsed format) are kept there.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.common import Result, Stack, cpu_s
from bench.throughput import TOOLS, TURNS, scripts, wait_all
from cmdop_worker.state.presence import online_machines

NAME = "profile"
FILLER_KEYS = 50_000


# Where a sample's time goes, by the frames on its stack: (label, [(function, file)]).
# A pattern matches a frame whose function is exactly `function` in a file whose path
# holds `file` (several patterns: the names this code had before and has now).
COORDINATOR_BUCKETS = (
    ("cmdop.turn task, all of it (execute_turn)", [("execute_turn", "turn")]),
    (
        "model call: SDK request + stream parsing",
        [
            ("_Call._stream", "llm"),
            ("_Call._create", "llm"),
            ("ApiCall._stream", "llm/attempt"),
            ("ApiCall._create", "llm/attempt"),
        ],
    ),
    ("  of which folding the stream events", [("ReplyStream.feed", "llm/wire")]),
    (
        "publish tool tasks",
        [
            ("publish_calls", "coordinator/calls"),
            ("send_to_machines", "coordinator/calls"),
            ("publish", "cmdop_worker/messages"),
        ],
    ),
    ("Celery task events (-E, sent events)", [("EventDispatcher.publish", "celery")]),
    ("tool catalogue + definitions", [("fleet_catalog", "core"), ("tool_definitions", "core")]),
    ("presence reads (online_machines)", [("online_machines", "presence")]),
    (
        "run state load + save",
        [
            ("RunStore.load_raw", "store"),
            ("parse_state", "state/"),
            ("RunStore.open_turn", "store"),
            ("RunStore.save", "store"),
        ],
    ),
    ("cancel reads (cancel_request)", [("RunStore.cancel_request", "store")]),
    (
        "turn lease (acquire, release)",
        [("TurnLease.acquire", "lease"), ("TurnLease.__exit__", "lease")],
    ),
    (
        "fleet rate limiter (3 scripts per model call)",
        [
            ("FleetLimiter.admit", "limiter"),
            ("FleetLimiter.learn", "limiter"),
            ("FleetLimiter.settle", "limiter"),
        ],
    ),
    ("run events (EventSink.emit)", [("EventSink.emit", "events")]),
    ("sanitize_history + build_request", [("sanitize_history", "core"), ("build_request", "core")]),
    ("Celery/kombu consumer loop", [("Channel._brpop_read", "kombu")]),
    (
        "watchdog + cancel hub threads",
        [("Watchdog._run", "watchdog"), ("CancelHub._run", "cancel")],
    ),
    ("logging (Celery task lines, httpx)", [("Logger._log", "logging")]),
)
MACHINE_BUCKETS = (
    ("Celery/kombu consumer loop (receive, ack)", [("Channel._brpop_read", "kombu")]),
    ("tool call (execute_tool_call)", [("execute_tool_call", "machine")]),
    (
        "  of which record (+ enqueue next turn)",
        [("record", "outcomes")],
    ),
    ("  of which enqueue next turn", [("enqueue_turn", "outcomes")]),
    ("  of which start (checks, mark, TOOL_START)", [("RunStore.start_call", "store")]),
    ("  of which gate + the tool itself", [("_gate_and_run", "machine")]),
    ("acknowledge (kombu QoS.ack)", [("QoS.ack", "kombu")]),
    ("Celery task events (-E)", [("EventDispatcher.publish", "celery")]),
    ("logging (Celery task lines)", [("Logger._log", "logging")]),
)


def read_samples(path: Path) -> list[tuple[list[str], int]]:
    """(frames, count) rows of a py-spy raw (collapsed) profile, line numbers dropped."""
    rows = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";") if f]
            rows.append((frames or ["(native)"], int(count)))
    return rows


def matches(frame: str, function: str, file_part: str) -> bool:
    return frame.startswith(function + " (") and file_part in frame


def shares(rows: list[tuple[list[str], int]], buckets: tuple[Any, ...]) -> dict[str, Any]:
    total = sum(count for _, count in rows) or 1
    own: collections.Counter[str] = collections.Counter()
    for frames, count in rows:
        own[frames[-1]] += count
    found = {}
    for label, patterns in buckets:
        hit = sum(
            count
            for frames, count in rows
            if any(matches(f, fn, part) for f in frames for fn, part in patterns)
        )
        found[label] = hit / total
    top_self = [(frame, count / total) for frame, count in own.most_common(6)]
    return {"samples": total, "buckets": found, "self": top_self}


def scan_cost_ms(st: Stack) -> float:
    started = time.perf_counter()
    for _ in range(10):
        online_machines(st.client.redis, st.client.keys)
    return (time.perf_counter() - started) / 10 * 1000


def fill(client: redis.Redis, count: int) -> None:
    for start in range(0, count, 5_000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(start + 5_000, count)):
            pipe.set(f"cmdop:run:filler{i}:state", "x", ex=600)
        pipe.execute()


def spy(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    """Sample `pid` until stopped (SIGINT); only the thread holding the GIL counts."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return None
    argv = [exe, "record", "-p", str(pid), "-r", "200", "-f", "raw", "--gil", "--nonblocking"]
    return subprocess.Popen(
        [*argv, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def measure(st: Stack, runs: int, tmp: Path) -> dict[str, Any]:
    prompts = scripts(st)
    wait_all(st, [st.client.submit(prompt=p).run_id for p in prompts], 60)
    admin = redis.Redis.from_url(st.redis.url, decode_responses=True)
    admin.config_resetstat()
    every = {
        "coordinator": st.pids("coordinator"),
        "machines": st.pids("machine"),
        "redis": [st.redis.process.pid],
        "fake": [st.fake.process.pid],
    }
    before = {k: sum(cpu_s(p) for p in v) for k, v in every.items()}
    spies = [
        spy(every["coordinator"][0], tmp / "coordinator.txt"),
        spy(every["machines"][0], tmp / "machine.txt"),
    ]
    ids = [st.client.submit(prompt=prompts[i % len(prompts)]).run_id for i in range(runs)]
    wait_all(st, ids, 240)
    for proc in spies:
        stop(proc)
    after = {k: sum(cpu_s(p) for p in v) for k, v in every.items()}
    stats = admin.info("commandstats")
    scan_ms = {admin.dbsize(): scan_cost_ms(st)}
    fill(admin, FILLER_KEYS)  # what ~5,000 more finished runs would leave for a day
    scan_ms[admin.dbsize()] = scan_cost_ms(st)
    admin.close()
    return {
        "cpu_ms": {k: (after[k] - before[k]) * 1000 for k in every},
        "commands": {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()},
        "online_machines_ms_by_keys": scan_ms,
    }


def run(quick: bool) -> Result:
    res = Result(NAME)
    runs = 10 if quick else 40
    keep = os.environ.get("CMDOP_BENCH_PROFILE_DIR")  # keep the raw profiles there
    tmp = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="cmdop-spy-"))
    tmp.mkdir(parents=True, exist_ok=True)
    with Stack(remote_fake=True) as st:
        found = measure(st, runs, tmp)
    turns, calls = runs * (TURNS + 1), runs * TURNS * TOOLS
    cpu, commands = found["cpu_ms"], {k: v / turns for k, v in found["commands"].items()}
    profiles = {
        name: shares(read_samples(tmp / f"{name}.txt"), buckets)
        for name, buckets in (("coordinator", COORDINATOR_BUCKETS), ("machine", MACHINE_BUCKETS))
        if (tmp / f"{name}.txt").exists()
    }
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)
    res.raw = {**found, "turns": turns, "tool_calls": calls, "profiles": profiles}
    res.add(
        "coordinator CPU per model turn",
        cpu["coordinator"] / turns,
        "ms",
        f"machines {cpu['machines'] / calls:.1f} ms per tool call;"
        f" redis {cpu['redis'] / turns:.1f} ms per turn",
    )
    top = sorted(commands.items(), key=lambda kv: -kv[1])[:4]
    res.add(
        "Redis commands per model turn (all clients)",
        sum(commands.values()),
        "cmds",
        ", ".join(f"{k} {v:.0f}" for k, v in top),
    )
    (small, small_ms), (big, big_ms) = sorted(found["online_machines_ms_by_keys"].items())
    res.add(
        f"online_machines() with {big:,} keys",
        big_ms,
        "ms",
        f"{small_ms:.1f} ms with {small:,} keys; called 2-3x per turn",
    )
    add_profile_rows(res, profiles)
    return res


def add_profile_rows(res: Result, profiles: dict[str, Any]) -> None:
    """The headline buckets; every bucket and the top self frames are in the JSON."""

    def share(name: str, label: str) -> float:
        return float(profiles[name]["buckets"][label] * 100)

    if "coordinator" in profiles:

        def c(label: str) -> float:
            return share("coordinator", label)

        res.add(
            "coord GIL: model call (SDK request + stream)",
            c("model call: SDK request + stream parsing"),
            "%",
            f"folding stream events {c('  of which folding the stream events'):.0f}%",
        )
        res.add(
            "coord GIL: publish tool tasks",
            c("publish tool tasks"),
            "%",
            f"Celery task events {c('Celery task events (-E, sent events)'):.0f}%,"
            f" logging {c('logging (Celery task lines, httpx)'):.1f}%",
        )
        res.add(
            "coord GIL: presence reads (online_machines)",
            c("presence reads (online_machines)"),
            "%",
            f"state load+save {c('run state load + save'):.1f}%, cancel reads"
            f" {c('cancel reads (cancel_request)'):.1f}%, lease"
            f" {c('turn lease (acquire, release)'):.1f}%, catalogue"
            f" {c('tool catalogue + definitions'):.1f}%, sanitize+build"
            f" {c('sanitize_history + build_request'):.1f}%",
        )
    if "machine" in profiles:

        def m(label: str) -> float:
            return share("machine", label)

        res.add(
            "machine GIL: Celery/kombu consumer (receive, ack)",
            m("Celery/kombu consumer loop (receive, ack)"),
            "%",
            f"ack {m('acknowledge (kombu QoS.ack)'):.1f}%, Celery task events"
            f" {m('Celery task events (-E)'):.1f}%, logging"
            f" {m('logging (Celery task lines)'):.1f}%",
        )
        res.add(
            "machine GIL: execute_tool_call",
            m("tool call (execute_tool_call)"),
            "%",
            f"record {m('  of which record (+ enqueue next turn)'):.0f}% (enqueue next turn"
            f" {m('  of which enqueue next turn'):.0f}%), start"
            f" {m('  of which start (checks, mark, TOOL_START)'):.0f}%, gate + tool"
            f" {m('  of which gate + the tool itself'):.0f}%",
        )
