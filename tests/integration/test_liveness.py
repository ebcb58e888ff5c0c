"""A machine that dies mid-call is noticed within seconds, not at the call's deadline."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet
from tests.procs import sleeper, sleeping_pids

pytestmark = pytest.mark.integration

TOOL_TIMEOUT_MS = 120_000  # the watchdog's deadline would be two minutes away


def test_a_dead_machine_is_answered_long_before_the_call_deadline(
    fleet_env, redis_server, script, tmp_path
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/3"  # own database: own queues
    env = {**fleet_env, "CMDOP_REDIS_URL": url, "CMDOP_PRESENCE_TTL_S": "1.5"}
    local = LocalFleet(env, logdir=tmp_path)
    command = sleeper(300)
    call = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": "mortal", "command": command, "timeout_ms": TOOL_TIMEOUT_MS},
    }
    try:
        local.start_coordinator()
        local.start_machine("mortal")
        local.wait_ready(["mortal"], timeout_s=60)
        with Client(Settings(redis_url=url)) as client:
            run = client.submit(prompt=script([[call], [{"type": "text", "text": "carried on"}]]))
            for event in run.events():
                if event.type == "TOOL_START":
                    local.workers["mortal"].kill()
                    break
            # Far inside the call's two-minute deadline: only the presence probe can end it.
            result = run.wait(timeout=45)
            end = next(e for e in run.events() if e.type == "TOOL_END")
    finally:
        local.stop()
        for pid in sleeping_pids(command):  # an orphaned sleep, if the sandbox left one
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert result.status == "done" and result.text == "carried on"
    assert end.data["status"] == "lost" and "machine lost" in end.data["output"]
    assert end.data["machine"] == "mortal"
