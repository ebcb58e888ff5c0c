"""A coordinator with no model configured: it says so at start, and runs fail at once.

A real coordinator process on a Redis of its own, with neither `ANTHROPIC_API_KEY` nor
`ANTHROPIC_BASE_URL` in its environment (the session's conftest strips both from this
process, and `LocalFleet` passes on only what it is given).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer

pytestmark = pytest.mark.integration

WARNING = "neither ANTHROPIC_API_KEY nor ANTHROPIC_BASE_URL is set on the coordinator"


@dataclass
class Keyless:
    fleet: LocalFleet
    client: Client

    def coordinator_log(self) -> str:
        return self.fleet.workers["coordinator"].log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyless]:
    server = RedisServer().start()
    env = {"CMDOP_REDIS_URL": server.url, "CMDOP_WATCHDOG_INTERVAL_S": "0.05"}
    local = LocalFleet(env, logdir=tmp_path_factory.mktemp("keyless-logs"))
    try:
        local.start_coordinator()
        local.wait_ready([], timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield Keyless(local, client)
    finally:
        local.stop()
        server.stop()


def test_the_coordinator_warns_once_at_start_naming_both_variables_and_the_fake(
    keyless: Keyless,
) -> None:
    log = keyless.coordinator_log()
    assert log.count(WARNING) == 1, log
    line = next(line for line in log.splitlines() if WARNING in line)
    assert "WARNING" in line
    assert "cmdop-worker fake-model" in line


def test_a_run_fails_at_its_first_model_call_without_retrying(keyless: Keyless) -> None:
    run = keyless.client.submit(prompt="how is the fleet?")
    result = run.wait(timeout=30, raise_on_failure=False)
    events = list(run.events(idle_timeout_s=5))

    assert result.status == "error"
    assert result.error is not None
    assert result.error.kind == "model_no_credentials"
    assert result.error.message.startswith(WARNING)
    assert "attempts" not in result.error.message  # no request was ever sent
    assert [e.type for e in events if e.type == "RETRY"] == []
