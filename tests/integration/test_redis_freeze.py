"""Redis freezes for longer than a turn's lease while the model is answering.

A private redis-server is stopped with SIGSTOP for 9 s against a 3 s lease while six
runs wait for their model's first reply (it arrives during the freeze), then resumed
with SIGCONT. Every turn lock lapses in Redis meanwhile, and every watchdog entry comes
due. The executors must carry their turns on with the replies they already have: each
run ends DONE, each run's tool runs once, and no run asks the model again for a reply
it has (`coordinator.lease`: the holder takes back a lapsed lease nobody took).

The stream's idle timeout is set well above the scripted latency: on a loaded machine a
reply scripted to start after 1.5 s can start after more than the default 2 s, and a
stream that idle falls back, by design, to a second (non-streaming) request.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.procs import wait_for

from ..conftest import ScriptFactory, isolated_env, repo_root

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MACHINE = "freeze-a"
RUNS = 6
LEASE_S = 3
FREEZE_S = 9


@pytest.fixture(scope="module")
def frozen_fleet(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RedisServer, Client]]:
    server = RedisServer().start()
    env = isolated_env(
        server.url,
        fake_model,
        lease_s=str(LEASE_S),
        # Longer than the freeze: the machine still reads online once Redis is back.
        presence_ttl_s="30",
        worker_concurrency=str(RUNS + 2),
        permission_mode="bypass",
        policy_file=str(repo_root() / "tests" / "writable_tmp.toml"),
        max_turns="5",
        # Far above the 1.5 s scripted latency (module docstring).
        stream_idle_timeout_s="30",
    )
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("freeze-logs"))
    client = Client(Settings(redis_url=server.url))
    try:
        fleet.start_coordinator()
        fleet.start_machine(MACHINE)
        fleet.wait_ready([MACHINE], timeout_s=60)
        yield server, client
    finally:
        client.close()
        fleet.stop()
        server.stop()


def _freeze(server: RedisServer, seconds: float) -> None:
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def _explain(requests: list[dict], frozen_at_ms: float) -> None:
    """Print what each model request of a run that asked again was, for the failure's log."""
    for rec in requests:
        body, response = rec["body"], rec["response"] or {}
        print(
            f"  at {rec['received_ms'] - frozen_at_ms:+.0f} ms from the freeze:"
            f" {len(body.get('messages', []))} messages, stream={body.get('stream')},"
            f" fault={response.get('fault')}"
        )


def test_a_freeze_longer_than_the_lease_loses_no_run_and_repeats_no_tool(
    frozen_fleet, fake_model: FakeAnthropic, tmp_path: Path
) -> None:
    server, client = frozen_fleet
    script = ScriptFactory(fake_model)
    marks = tmp_path / "marks"
    prompts = []
    for n in range(RUNS):
        tool = {
            "type": "tool_use",
            "name": "execute_command",
            "input": {"machine": MACHINE, "command": f"echo run{n} >> {marks}"},
        }
        # The first reply comes during the freeze: asked before it, answered inside it.
        first = {"content": [{"type": "text", "text": "on it"}, tool], "latency_ms": 1500}
        prompts.append(script([first, [{"type": "text", "text": f"done {n}"}]]))
    runs = [client.submit(prompt=f"{p} {uuid.uuid4().hex[:6]}", timeout_s=120) for p in prompts]
    wait_for(lambda: all(script.requests_for(p) for p in prompts), 30, "every run's first request")

    frozen_at_ms = time.monotonic() * 1000
    _freeze(server, FREEZE_S)

    results = [run.wait(timeout=120) for run in runs]
    assert [r.status for r in results] == ["done"] * RUNS  # no run lost
    assert [r.text for r in results] == [f"done {n}" for n in range(RUNS)]
    # Two turns each: no reply received before or during the freeze was asked for again.
    asked = [len(script.requests_for(p)) for p in prompts]
    for p, n in zip(prompts, asked, strict=True):
        if n != 2:
            _explain(script.requests_for(p), frozen_at_ms)
    assert asked == [2] * RUNS
    # Every tool ran exactly once.
    assert sorted(marks.read_text().split()) == sorted(f"run{n}" for n in range(RUNS))
