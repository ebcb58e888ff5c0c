"""A machine worker SIGKILLed mid-call (isolated fleet `iso`): the call is declared
lost once its presence expires, long before the orphaned command could answer."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Run
from tests.procs import wait_for

from .machine_runs import (
    Iso,
    finish,
    use,
)

pytestmark = pytest.mark.integration


def test_machine_killed_mid_call_is_lost_and_the_run_goes_on(iso, script) -> None:
    token = f"27.{uuid.uuid4().int % 1000:03d}"
    timeout_ms = 3_000
    grace_ms = int(iso.env["CMDOP_TOOL_GRACE_MS"])
    ttl_s = float(iso.env["CMDOP_PRESENCE_TTL_S"])
    call = use("execute_command", machine="doomed", command=f"sleep {token}", timeout_ms=timeout_ms)
    prompt = script([[call], [{"type": "text", "text": "after the loss: {{result:0}}"}]])
    killer = Killer(iso, "doomed", ttl_s, token)
    try:
        done = finish(iso.client, prompt, killer.on_event)
    finally:
        _kill_orphan_sleep(token)
    assert done.result.status == "done"
    (start,) = done.of("TOOL_START")
    (end,) = done.ends
    assert end.data["status"] == "lost"
    assert end.data["output"] == "started on doomed; outcome unknown; machine lost"
    # Declared lost long before the orphaned sleep (27 s) could have answered.
    assert end.ts_ms - start.ts_ms < 3 * (timeout_ms + grace_ms)
    assert done.result.text == "after the loss: started on doomed; outcome unknown; machine lost"
    # The presence key carried the configured TTL when the worker died, and expired.
    assert killer.ttl_ms_at_kill is not None and 0 < killer.ttl_ms_at_kill <= ttl_s * 1000
    assert killer.presence_expired


@dataclass
class Killer:
    """SIGKILLs a machine worker once its command runs, then waits its presence out."""

    iso: Iso
    machine: str
    ttl_s: float
    token: str
    ttl_ms_at_kill: int | None = None
    presence_expired: bool = False

    def on_event(self, run: Run, event: Event) -> None:
        if event.type != "TOOL_START":
            return
        wait_for(lambda: _sleep_pids(self.token), 20, "the command's start")
        redis = self.iso.client.redis
        key = self.iso.client.keys.machine(self.machine)
        self.ttl_ms_at_kill = redis.pttl(key)
        self.iso.fleet.workers[self.machine].kill()
        wait_for(lambda: not redis.exists(key), 5 * self.ttl_s, "presence expiry")
        self.presence_expired = True


def _sleep_pids(token: str) -> list[int]:
    """Pids of running `sleep <token>` processes."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"sleep", token.encode()]:
            pids.append(int(proc.name))
    return pids


def _kill_orphan_sleep(token: str) -> None:
    """The killed worker's `sleep` lives on in its own session: end it by pid."""
    for pid in _sleep_pids(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
