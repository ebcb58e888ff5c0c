"""4. Streaming and cancel latency, seen by a client following a run's events.

(a) ui cancel -> CANCELLED received, while a machine runs `sleep 30`;
(b) ui cancel -> that tool's process gone (a `sleep` with a duration no other process
    has, found by its command line on the host — the sandbox hides host pids from the
    tool; gone = /proc/<pid> missing or a zombie);
(c) ui cancel -> CANCELLED received, with the model mid-stream (token_delay_ms);
(d) TOKEN: the coordinator's `ts_ms` (wall clock, whole ms, set when it emits) ->
    received by a client through `Client.events` (XREAD BLOCK). `ts_ms` is truncated
    to the ms, so each sample reads high by 0.5 ms on average; the table shows it raw.

20 tries of (a)+(b) and of (c), 4 streamed runs for (d) (5 tries, 1 run with --quick).
(a) and (b) run on `alpha`, whose tools are sandboxed, and in the same rounds on `beta`
with `CMDOP_SANDBOX=off`, the baseline the sandboxed figures are shown against.
The follower is a thread started right after submit; cancel time is taken just before
`Client.cancel(ui=True)`. Targets: (a),(c) p95 < 100 ms; (b) p95 < 150 ms; (d) p50 < 2 ms.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Result, Stack, check, pct, summary, text, tool_use, wall_ms

NAME = "latency"
STREAM_TEXT = " ".join(f"word{i}" for i in range(300))


class Follower(threading.Thread):
    """Reads a run's events; stamps (wall ms) the first TOKEN, each TOKEN, the end."""

    def __init__(self, st: Stack, run_id: str) -> None:
        super().__init__(daemon=True)
        self.st, self.run_id = st, run_id
        self.first_token = threading.Event()
        self.token_lags: list[float] = []
        self.end_ms = float("nan")
        self.end_type = ""
        self.start()

    def run(self) -> None:
        for event in self.st.client.events(self.run_id, idle_timeout_s=30):
            now = wall_ms()
            if event.type == "TOKEN":
                self.token_lags.append(now - event.ts_ms)
                self.first_token.set()
            if event.is_terminal:
                self.end_ms, self.end_type = now, event.type


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    give_up = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > give_up:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.0005)


def sleeping_pid(argv: list[str]) -> int | None:
    """The host pid of the process whose argv is exactly `argv`, if one runs."""
    wanted = b"\0".join(a.encode() for a in argv) + b"\0"
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == wanted:
                return int(entry.name)
        except OSError:
            continue
    return None


def process_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def cancel_tool_once(st: Stack, machine: str, serial: int) -> tuple[float, float]:
    """(cancel -> CANCELLED ms, cancel -> process gone ms) for one run."""
    argv = ["sleep", f"30.{serial:06d}"]
    call = tool_use("execute_command", machine=machine, command=f"exec {' '.join(argv)}")
    prompt = st.script([[call], text("unreachable")])
    run = st.client.submit(prompt=prompt, timeout_s=60)
    follower = Follower(st, run.run_id)
    wait_for(lambda: sleeping_pid(argv) is not None, 30, "the tool's process")
    pid = sleeping_pid(argv)
    assert pid is not None
    started = wall_ms()
    st.client.cancel(run.run_id, ui=True)
    wait_for(lambda: process_gone(pid), 10, f"process {pid} to end")
    gone = wall_ms() - started
    follower.join(timeout=10)
    if follower.end_type != "CANCELLED":
        raise RuntimeError(f"run ended with {follower.end_type or 'nothing'}, not CANCELLED")
    return follower.end_ms - started, gone


def cancel_stream_once(st: Stack, prompt: str) -> float:
    run = st.client.submit(prompt=prompt, timeout_s=60)
    follower = Follower(st, run.run_id)
    if not follower.first_token.wait(30):
        raise RuntimeError("no TOKEN arrived")
    started = wall_ms()
    st.client.cancel(run.run_id, ui=True)
    follower.join(timeout=10)
    if follower.end_type != "CANCELLED":
        raise RuntimeError(f"run ended with {follower.end_type or 'nothing'}, not CANCELLED")
    return follower.end_ms - started


def token_lags(st: Stack, prompt: str) -> list[float]:
    run = st.client.submit(prompt=prompt, timeout_s=60)
    follower = Follower(st, run.run_id)
    follower.join(timeout=60)
    return follower.token_lags


def run(quick: bool) -> Result:
    res = Result(NAME)
    tries = 5 if quick else 20
    # Unsandboxed tools have the network: the bench's Redis has no password.
    unboxed = {"CMDOP_SANDBOX": "off", "CMDOP_ALLOW_OPEN_REDIS": "1"}
    with Stack(machine_env={"beta": unboxed}) as st:
        stream_prompt = st.script([text(STREAM_TEXT)], token_delay_ms=50)
        token_prompt = st.script([text(STREAM_TEXT)], token_delay_ms=2)
        st.client.submit(prompt=st.script([text("warm")])).wait(timeout=30)
        tool, bare = [], []
        for i in range(tries):
            tool.append(cancel_tool_once(st, "alpha", 2 * i))
            bare.append(cancel_tool_once(st, "beta", 2 * i + 1))
        stream = [cancel_stream_once(st, stream_prompt) for _ in range(tries)]
        lags = [lag for _ in range(1 if quick else 4) for lag in token_lags(st, token_prompt)]
    cancelled, gone = [c for c, _ in tool], [g for _, g in tool]
    bare_cancelled, bare_gone = [c for c, _ in bare], [g for _, g in bare]
    res.raw = {
        "cancel_tool_to_cancelled_ms": summary(cancelled),
        "cancel_to_process_gone_ms": summary(gone),
        "cancel_stream_to_cancelled_ms": summary(stream),
        "token_lag_ms": summary(lags),
        "unsandboxed_cancel_to_process_gone_ms": summary(bare_gone),
        "samples": {"tool": tool, "unsandboxed_tool": bare, "stream": stream},
    }
    rows = (
        ("(a) ui cancel -> CANCELLED, tool running", cancelled, bare_cancelled, 100.0),
        ("(b) ui cancel -> tool process gone", gone, bare_gone, 150.0),
        ("(c) ui cancel -> CANCELLED, model streaming", stream, [], 100.0),
    )
    for label, values, baseline, limit in rows:
        unsandboxed = f"; unsandboxed p95 {pct(baseline, 95):.1f}" if baseline else ""
        res.add(
            f"{label}, p95",
            pct(values, 95),
            "ms",
            f"p50 {pct(values, 50):.1f}, n={len(values)}{unsandboxed}; target p95 < {limit:.0f}",
            check(pct(values, 95), limit),
        )
    res.add(
        "(d) TOKEN coordinator emit -> client receive, p50",
        pct(lags, 50),
        "ms",
        f"p95 {pct(lags, 95):.1f}, n={len(lags)}; target p50 < 2",
        check(pct(lags, 50), 2.0),
    )
    return res
