"""`timeout_s` is a deadline from the submit: a start no coordinator took in time never runs.

A private fleet whose coordinator starts only after the runs were submitted. A run whose
timeout passed meanwhile ends CANCELLED by the timeout as soon as a coordinator takes
it: the model is never asked and its command never runs. A run still inside its timeout
runs, with its deadline counted from the submit, not from the late start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.procs import wait_for

from ..conftest import ScriptFactory, isolated_env, repo_root

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MACHINE = "late-a"


@pytest.fixture
def late_fleet(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalFleet, Client]]:
    server = RedisServer().start()
    env = isolated_env(
        server.url,
        fake_model,
        permission_mode="bypass",
        policy_file=str(repo_root() / "tests" / "writable_tmp.toml"),
    )
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("late-logs"))
    client = Client(Settings(redis_url=server.url))
    try:
        fleet.start_machine(MACHINE)
        fleet.wait_ready([MACHINE], coordinators=0, timeout_s=60)
        yield fleet, client
    finally:
        client.close()
        fleet.stop()
        server.stop()


def test_a_run_taken_after_its_deadline_is_cancelled_unrun_and_one_within_it_runs(
    late_fleet: tuple[LocalFleet, Client], fake_model: FakeAnthropic, tmp_path: Path
) -> None:
    fleet, client = late_fleet
    script = ScriptFactory(fake_model)
    marker = tmp_path / "ran"
    touch = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": MACHINE, "command": f"touch {marker}"},
    }
    late_prompt = script([{"content": [touch]}, [{"type": "text", "text": "touched"}]])
    ok_prompt = script([[{"type": "text", "text": "in time"}]])

    before_ms = time.time_ns() // 1_000_000
    late = client.submit(prompt=late_prompt, timeout_s=1)
    in_time = client.submit(prompt=ok_prompt, timeout_s=600)
    after_ms = time.time_ns() // 1_000_000
    # No coordinator yet: the first run's deadline passes while its start waits.
    wait_for(lambda: time.time_ns() // 1_000_000 > after_ms + 1500, 10, "the short deadline")
    fleet.start_coordinator()

    result = late.wait(timeout=60, raise_on_failure=False)
    assert (result.status, result.stop_reason) == ("cancelled", "timeout")
    assert result.cancel is not None and result.cancel.reason == "timeout"
    assert script.requests_for(late_prompt) == []  # the model was never asked
    assert not marker.exists()  # and the command never ran
    assert [e.type for e in client.events_so_far(late.run_id)][-1] == "CANCELLED"

    assert in_time.wait(timeout=60).text == "in time"
    state = client.store.load(in_time.run_id)
    assert state is not None
    # Counted from the submit, though the coordinator took it seconds later.
    assert before_ms + 600_000 <= state.deadline_ms <= after_ms + 600_000
    assert state.started_ms > after_ms + 1500
