"""What every benchmark shares: a private stack, timing helpers, result rows.

`Stack` brings up one benchmark's own world: a private redis-server (`RedisServer`),
the project's fake Anthropic server (in this process, or as a subprocess when the
benchmark process itself is busy), and a `LocalFleet` of worker subprocesses with the
benchmark's own settings, plus a `Client`. Workers load `bench.tools` through
`CMDOP_TOOL_MODULES`, which registers true no-op and sleep tools.

The fake server is instrumented here (bench-side only) so each recorded request also
carries `sent_ms`: when the response was fully written. With `received_ms` (set by the
server itself) that is the model's own time as the server saw it. Both are
`time.monotonic()` ms, the same clock in every process on this host.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cmdop_worker.config import DEFAULT_MODEL_ALIASES, Settings
from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing import fake_anthropic as fa

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = DEFAULT_MODEL_ALIASES["sonnet"]  # the peers ask for the model the fleet asks for


def mono_ms() -> float:
    return time.monotonic() * 1000


def wall_ms() -> float:
    return time.time_ns() / 1e6


def wall_to_mono_ms() -> float:
    """Add to a wall-clock ms timestamp (an event's `ts_ms`) to get monotonic ms."""
    return mono_ms() - wall_ms()


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p95": pct(values, 95),
        "mean": statistics.fmean(values) if values else float("nan"),
        "min": min(values, default=float("nan")),
        "max": max(values, default=float("nan")),
    }


@dataclass
class Row:
    metric: str
    value: float
    unit: str
    vs: str = ""  # the reference, e.g. "bare chord 24.1 ms" or "target < 1.10"
    verdict: str = ""  # "ok", "MISS", or a ratio


@dataclass
class Result:
    name: str
    rows: list[Row] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    def add(self, metric: str, value: float, unit: str, vs: str = "", verdict: str = "") -> None:
        self.rows.append(Row(metric, value, unit, vs, verdict))


def check(value: float, limit: float) -> str:
    return "ok" if value <= limit else "MISS"


# --- the fake model server ------------------------------------------------------------

_local = threading.local()
_original_record = fa._State.record
_original_carry_out = fa._Handler._carry_out


def _record(self: Any, *args: Any, **kwargs: Any) -> Any:
    entry = _original_record(self, *args, **kwargs)
    _local.entry = entry
    return entry


def _carry_out(self: Any, answer: Any, stream: bool) -> None:
    try:
        _original_carry_out(self, answer, stream)
    finally:
        entry = getattr(_local, "entry", None)
        if entry is not None:
            entry["sent_ms"] = mono_ms()


fa._State.record = _record  # type: ignore[method-assign]
fa._Handler._carry_out = _carry_out  # type: ignore[method-assign]


class RemoteFake:
    """The fake server as a subprocess, with the control API `FakeAnthropic` has."""

    def __init__(self) -> None:
        argv = [sys.executable, "-m", "cmdop_worker.testing.fake_anthropic", "--port", "0"]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().decode().strip()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("content-type", "application/json")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def add_script(self, name: str, script: Any) -> None:
        self._call("PUT", f"/_fake/scripts/{name}", script)

    def requests(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/_fake/requests"))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def requests_for(fake: Any, marker: str) -> list[dict[str, Any]]:
    """Recorded /v1/messages requests whose first user message holds `marker`, in order."""
    found = []
    for rec in fake.requests():
        messages = (rec.get("body") or {}).get("messages") or []
        first = messages[0]["content"] if messages else ""
        text = first if isinstance(first, str) else json.dumps(first)
        if marker in text:
            found.append(rec)
    return sorted(found, key=lambda r: r["received_ms"])


# --- a private stack --------------------------------------------------------------------


def fleet_env(redis_url: str, fake_url: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {
        "CMDOP_REDIS_URL": redis_url,
        "ANTHROPIC_BASE_URL": fake_url,
        "ANTHROPIC_API_KEY": "sk-bench-not-a-key",
        "CMDOP_PERMISSION_MODE": "bypass",
        "CMDOP_TOOL_MODULES": '["bench.tools"]',
        "PYTHONPATH": path,
        **extra,
    }


_script_names = itertools.count(1)  # one sequence per process: stacks may share a fake


class Stack:
    """Redis + fake model + fleet + client for one benchmark; a context manager.

    With `fake` (another stack's), this fleet talks to that server and leaves it running.
    """

    def __init__(
        self,
        *,
        machines: Sequence[str] = ("alpha", "beta"),
        coordinators: int = 1,
        remote_fake: bool = False,
        env: dict[str, str] | None = None,
        machine_env: dict[str, dict[str, str]] | None = None,
        fake: Any = None,
    ) -> None:
        self.machines = list(machines)
        self.machine_env = machine_env or {}
        self.coordinators = coordinators
        self.remote_fake = remote_fake
        self.extra_env = env or {}
        self.shared_fake = fake

    def __enter__(self) -> Stack:
        return self.launch().ready()

    def launch(self) -> Stack:
        """Start Redis, the fake and the workers, without waiting for the workers: a
        benchmark with several stacks launches them all, then waits for each."""
        self.redis = RedisServer().start()
        try:
            self.fake: Any = self.shared_fake or (
                RemoteFake() if self.remote_fake else fa.FakeAnthropic().start()
            )
            self.env = fleet_env(self.redis.url, self.fake.url, **self.extra_env)
            self.fleet = LocalFleet(self.env)
            for i in range(self.coordinators):
                self.fleet.start_coordinator(f"coordinator-{i}")
            for machine in self.machines:
                self.fleet.start_machine(machine, self.machine_env.get(machine))
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def ready(self) -> Stack:
        """Wait for the launched workers; then the stack has its client."""
        try:
            self.fleet.wait_ready(self.machines, coordinators=self.coordinators, timeout_s=90)
            self.client = Client(Settings(redis_url=self.redis.url))
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        if getattr(self, "fleet", None) is not None:
            # SIGKILL, not a warm shutdown: this Redis is thrown away, and a graceful
            # stop of every worker costs the suite ~1.5 s per stack.
            for worker in self.fleet.workers.values():
                worker.kill()
        if getattr(self, "fake", None) is not None and self.fake is not self.shared_fake:
            self.fake.stop()
        self.redis.stop()
        shutil.rmtree(self.redis.workdir, ignore_errors=True)
        if getattr(self, "fleet", None) is None:
            return
        if not exc or exc[0] is None:
            shutil.rmtree(self.fleet.logdir, ignore_errors=True)
        else:
            print(f"  (fleet logs kept in {self.fleet.logdir})", file=sys.stderr)

    def script(self, turns: list[Any], **options: Any) -> str:
        """Register a script; returns the prompt that selects it."""
        name = f"b{os.getpid()}x{next(_script_names)}"
        self.fake.add_script(name, {"turns": turns, **options})
        return f"[[script:{name}]] go"

    def events(self, run_id: str, timeout_s: float = 60) -> list[Event]:
        return list(self.client.events(run_id, idle_timeout_s=timeout_s))

    def pids(self, role: str) -> list[int]:
        """Worker pids: role "coordinator" or "machine"."""
        is_coord = role == "coordinator"
        return [
            w.pid for n, w in self.fleet.workers.items() if n.startswith("coordinator") == is_coord
        ]


def open_stacks(worlds: ExitStack, *stacks: Stack) -> None:
    """Launch every stack, then wait for each (their workers start side by side); each
    is torn down with `worlds`."""
    for st in stacks:
        worlds.push(st.launch())
    for st in stacks:
        st.ready()


def tool_use(name: str, **args: Any) -> dict[str, Any]:
    return {"type": "tool_use", "name": name, "input": args}


def text(value: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": value}]


def spread(machines: Sequence[str], n: int, make: Callable[[str], dict[str, Any]]) -> list[Any]:
    """n tool calls, round-robin over the machines."""
    return [make(machines[i % len(machines)]) for i in range(n)]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB; NaN when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
