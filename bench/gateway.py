"""9. The HTTP gateway: what following a run over SSE costs against reading Redis directly.

(a) TOKEN latency: the coordinator's `ts_ms` (wall clock, set when it emits) -> received.
    Every streamed run is followed at once by three readers: the client (`Client.events`,
    XREAD BLOCK on Redis: the baseline), an SSE client through the gateway
    (`/v1/runs/{id}/events`, http.client), and — when Debian's chromium is installed —
    a browser page reading the same SSE with `fetch` (Playwright), so all three see the
    same tokens at the same moments. `ts_ms` is truncated to the ms: each figure reads
    high by ~0.5 ms alike.
(b) events/s replaying a finished run of 5,000 events: the client vs the SSE client,
    in interleaved rounds with the order alternated.

Ratios are gateway / direct from the same runs. The gateway runs as its own uvicorn
process on loopback, without tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import Result, Stack, pct, summary, text, wall_ms
from cmdop_worker.state.connect import now_ms
from cmdop_worker.state.events import EventSink
from cmdop_worker.surfaces.fleet import free_port

NAME = "gateway"
STREAM_TEXT = " ".join(f"word{i}" for i in range(300))
REPLAY_EVENTS = 5_000
CHROMIUM = "/usr/bin/chromium"
BROWSER_READER = """async (path) => {
  const lags = [];
  const res = await fetch(path);
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return lags;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\\r\\n\\r\\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 4);
      const data = block.split("\\r\\n").find((l) => l.startsWith("data: "));
      if (!data) continue;
      const event = JSON.parse(data.slice(6));
      if (event.type === "TOKEN") lags.push(Date.now() - event.ts_ms);
    }
  }
}"""


class Gateway:
    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        argv = [str(Path(sys.executable).with_name("cmdop-worker")), "gateway"]
        argv += ["--port", str(self.port)]
        self.process = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("the gateway did not answer /healthz")

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=10)


def sse_events(gw: Gateway, run_id: str, on_event: Any) -> None:
    """Read the run's SSE to its end, calling `on_event(event_dict)` for each."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    try:
        conn.request("GET", f"/v1/runs/{run_id}/events")
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"events answered {response.status}")
        while line := response.readline():
            if line.startswith(b"data: "):
                on_event(json.loads(line[6:]))
    finally:
        conn.close()


class Follower(threading.Thread):
    """Runs `read(seen)` in a thread; `seen` stamps each TOKEN's lag (a dict or an Event)."""

    def __init__(self, read: Any) -> None:
        super().__init__(daemon=True)
        self.read = read
        self.lags: list[float] = []
        self.start()

    def seen(self, event: Any) -> None:
        at = wall_ms()
        raw = event if isinstance(event, dict) else event.model_dump()
        if raw["type"] == "TOKEN":
            self.lags.append(at - raw["ts_ms"])

    def run(self) -> None:
        self.read(self.seen)


def streamed_run(st: Stack, gw: Gateway, prompt: str, page: Any) -> dict[str, list[float]]:
    run = st.client.submit(prompt=prompt, timeout_s=60)
    run_id = run.run_id

    def direct(seen: Any) -> None:
        for event in st.client.events(run_id, idle_timeout_s=30):
            seen(event)

    readers = {
        "direct": Follower(direct),
        "sse": Follower(lambda seen: sse_events(gw, run_id, seen)),
    }
    browser = page.evaluate(BROWSER_READER, f"/v1/runs/{run_id}/events") if page else []
    for follower in readers.values():
        follower.join(timeout=60)
    return {"direct": readers["direct"].lags, "sse": readers["sse"].lags, "browser": browser}


def synthetic_run(st: Stack) -> str:
    """A finished run of REPLAY_EVENTS events, written as the fleet writes them."""
    run_id = f"bench-replay-{os.getpid()}"
    keys, maxlen = st.client.keys, REPLAY_EVENTS * 2
    sink = EventSink(st.client.redis, keys, maxlen=maxlen, ttl_s=3600, clock_ms=now_ms)
    for i in range(REPLAY_EVENTS - 1):
        sink.emit(run_id, "TOKEN", 1, {"text": f"w{i} "})
    usage = {"input_tokens": 1, "output_tokens": 1}
    done = {"text": "", "usage": usage, "turns": 1, "stop_reason": "end_turn"}
    sink.emit(run_id, "DONE", 1, done)
    return run_id


def replay_rate(read: Any) -> float:
    count = 0

    def seen(_: Any) -> None:
        nonlocal count
        count += 1

    started = time.perf_counter()
    read(seen)
    elapsed = time.perf_counter() - started
    if count != REPLAY_EVENTS:
        raise RuntimeError(f"replayed {count} events, not {REPLAY_EVENTS}")
    return count / elapsed


def open_page(gw: Gateway) -> tuple[Any, Any]:
    if not Path(CHROMIUM).exists():
        return None, None
    from playwright.sync_api import sync_playwright

    driver = sync_playwright().start()
    browser = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    page = browser.new_context(bypass_csp=True).new_page()
    page.goto(gw.url + "/")
    return driver, page


def run(quick: bool) -> Result:
    res = Result(NAME)
    with Stack() as st:
        gw = Gateway(st.env)
        driver, page = open_page(gw)
        try:
            prompt = st.script([text(STREAM_TEXT)], token_delay_ms=2)
            st.client.submit(prompt=st.script([text("warm")])).wait(timeout=30)
            lags: dict[str, list[float]] = {"direct": [], "sse": [], "browser": []}
            for _ in range(1 if quick else 4):
                for side, values in streamed_run(st, gw, prompt, page).items():
                    lags[side] += values
            replay_id = synthetic_run(st)
            direct_read = lambda seen: [seen(e) for e in st.client.events(replay_id)]  # noqa: E731
            sse_read = lambda seen: sse_events(gw, replay_id, seen)  # noqa: E731
            rates: dict[str, list[float]] = {"direct": [], "sse": []}
            for i in range(2 if quick else 6):
                order = [("direct", direct_read), ("sse", sse_read)][:: 1 if i % 2 else -1]
                for side, read in order:
                    rates[side].append(replay_rate(read))
        finally:
            if driver is not None:
                driver.stop()
            gw.stop()
    report(res, lags, rates)
    return res


def report(res: Result, lags: dict[str, list[float]], rates: dict[str, list[float]]) -> None:
    res.raw = {
        "token_lag_ms": {side: summary(values) for side, values in lags.items()},
        "replay_events_per_s": {side: summary(values) for side, values in rates.items()},
    }
    direct = pct(lags["direct"], 50)
    baseline = f"p95 {pct(lags['direct'], 95):.1f}, n={len(lags['direct'])}; the baseline"
    res.add("(a) TOKEN emit -> client (Redis XREAD), p50", direct, "ms", baseline)
    for side, label in (("sse", "SSE client via gateway"), ("browser", "browser via gateway")):
        if not lags[side]:
            res.add(f"(a) TOKEN emit -> {label}", float("nan"), "ms", "no chromium: skipped")
            continue
        p50 = pct(lags[side], 50)
        vs = f"p95 {pct(lags[side], 95):.1f}, n={len(lags[side])}; direct p50 {direct:.2f}"
        res.add(f"(a) TOKEN emit -> {label}, p50", p50, "ms", vs, f"{p50 / direct:.2f}x direct")
    d, s = pct(rates["direct"], 50), pct(rates["sse"], 50)
    ratios = [sse / direct for sse, direct in zip(rates["sse"], rates["direct"], strict=True)]
    spread = f"per-round ratios {min(ratios):.2f}-{max(ratios):.2f}, n={len(ratios)}"
    res.add("(b) replay, client (Redis), median", d, "events/s", f"{REPLAY_EVENTS} events")
    res.add("(b) replay, SSE via gateway, median", s, "events/s", spread, f"{s / d:.2f}x direct")
