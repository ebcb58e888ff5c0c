"""Redis restarts mid-run; with append-only persistence the run completes.

A private redis-server with `--appendonly yes` is stopped while a tool runs and started
again two seconds later on the same port and data directory. The run must end DONE
with one terminal event and gap-free events (read by a client that followed it across
the restart), and every worker's background thread must have reconnected: the machine
heartbeat (its presence key is back), the coordinator watchdog (its key is back) and
the cancel hubs (a ui cancel afterwards kills a running tool at once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.models import TERMINAL_EVENTS, Event
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.procs import sleeper, ui_cancel_stops, wait_for, wait_for_sleeper

from ..conftest import repo_root

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MACHINE = "restart-a"


@pytest.fixture(scope="module")
def durable(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RedisServer, LocalFleet, Client]]:
    server = RedisServer(appendonly=True).start()
    env = {
        "CMDOP_REDIS_URL": server.url,
        "ANTHROPIC_BASE_URL": fake_model.url,
        "ANTHROPIC_API_KEY": "sk-test-secret-do-not-leak",
        "CMDOP_PERMISSION_MODE": "bypass",
        "CMDOP_POLICY_FILE": str(repo_root() / "tests" / "writable_tmp.toml"),
        "CMDOP_LLM_BACKOFF_BASE_S": "0.05",
        "CMDOP_LLM_BACKOFF_MAX_S": "0.5",
        # Longer than the outage: a machine's presence (persisted with its TTL) outlives
        # it. After a longer one, machines read offline until their next heartbeat.
        "CMDOP_PRESENCE_TTL_S": "6",
        "CMDOP_PRESENCE_REFRESH_S": "0.5",
        "CMDOP_WATCHDOG_INTERVAL_S": "0.05",
        "CMDOP_VISIBILITY_TIMEOUT_S": "10",
        "CMDOP_BROKER_RESTORE_INTERVAL_S": "1",
        "CMDOP_BROKER_RESTORE_THROTTLE": "1",
        "CMDOP_LEASE_S": "3",
        "CMDOP_WORKER_CONCURRENCY": "4",
    }
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("restart-logs"))
    client = Client(Settings(redis_url=server.url))
    try:
        fleet.start_coordinator()
        fleet.start_machine(MACHINE)
        fleet.wait_ready([MACHINE], timeout_s=60)
        yield server, fleet, client
    finally:
        client.close()
        fleet.stop()
        server.stop()


def tool(command: str) -> dict[str, object]:
    return {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": MACHINE, "command": command},
    }


def follow(client: Client, run_id: str, into: list[Event]) -> threading.Thread:
    def read() -> None:
        into.extend(client.events(run_id, idle_timeout_s=60))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_run_completes_across_a_redis_restart(durable, fake_model, tmp_path: Path) -> None:
    server, fleet, client = durable
    marks = tmp_path / "marks"
    name = "restart-run"
    fake_model.add_script(
        name,
        [
            [tool(f"echo one >> {marks}; sleep 1")],
            [tool(f"echo two >> {marks}; sleep 2")],
            [tool(f"echo three >> {marks}")],
            [{"type": "text", "text": "made it"}],
        ],
    )
    run = client.submit(prompt=f"[[script:{name}]] go", timeout_s=120)
    events: list[Event] = []
    reader = follow(client, run.run_id, events)
    wait_for(lambda: marks.exists() and "two" in marks.read_text(), 30, "turn 2's tool")

    server.stop()
    time.sleep(2)
    server.start()

    result = run.wait(timeout=90)
    reader.join(timeout=30)
    assert result.status == "done" and result.text == "made it"
    assert marks.read_text().split() == ["one", "two", "three"]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.type for e in events if e.type in TERMINAL_EVENTS] == ["DONE"]

    # The background threads reconnected: heartbeat, watchdog, cancel hubs.
    redis = client.redis
    wait_for(lambda: redis.exists(client.keys.machine(MACHINE)), 10, "the machine heartbeat")
    wait_for(
        lambda: list(redis.scan_iter(match=client.keys.coordinator_pattern)), 10, "the watchdog"
    )
    assert all(worker.alive() for worker in fleet.workers.values())


def test_cancel_still_reaches_running_tools_after_the_restart(
    durable, fake_model, tmp_path: Path
) -> None:
    _, _, client = durable
    sleep = sleeper(30)
    name = "after-restart"
    fake_model.add_script(name, [[tool(sleep)]])
    run = client.submit(prompt=f"[[script:{name}]] go", timeout_s=120)
    pid = wait_for_sleeper(sleep, 30)
    ui_cancel_stops(run, pid)  # the tool sleeps 30 s, longer than the checks wait


def test_a_broker_channel_publishes_through_one_client_until_its_pool_changes(
    redis_server,
) -> None:
    from kombu import Connection

    import cmdop_worker.celery_app  # noqa: F401  (every fleet process imports it: the patch)

    with Connection(redis_server.url) as connection:
        channel = connection.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
        producer = connection.Producer()
        for n in range(3):
            producer.publish({"n": n}, routing_key="cmdop-test-reuse", serializer="json")
        assert len(channel.client.lrange("cmdop-test-reuse", 0, -1)) == 3
        channel._disconnect_pools()  # what kombu does after a fork or a lost connection
        with channel.conn_or_acquire() as third:
            assert third is not first
            assert third.connection_pool is channel.pool
        channel.client.delete("cmdop-test-reuse")


def test_an_outage_is_one_warning_per_process_and_one_line_when_redis_is_back(
    durable, fake_model, tmp_path: Path
) -> None:
    server, fleet, client = durable
    logs = {name: worker.log_path for name, worker in fleet.workers.items()}
    before = {name: len(path.read_text().splitlines()) for name, path in logs.items()}

    server.stop()
    time.sleep(4)  # the watchdog alone tries 80 times meanwhile, the heartbeat 8
    server.start()
    wait_for(lambda: client.redis.exists(client.keys.machine(MACHINE)), 20, "the heartbeat")

    def ours(name: str) -> list[str]:
        lines = logs[name].read_text().splitlines()[before[name] :]
        return [line for line in lines if " cmdop_worker." in line]

    def back(name: str) -> bool:
        return any("Redis reachable again" in line for line in ours(name))

    for name in logs:
        wait_for(lambda name=name: back(name), 20, f"{name}'s line that Redis is back")
        lines = ours(name)
        down = [line for line in lines if "Redis unreachable" in line]
        assert len(down) == 1, lines
        assert " WARNING " in down[0]
        warnings = [line for line in lines if " WARNING " in line or " ERROR " in line]
        assert warnings == down, warnings  # nothing else of ours repeats the outage
