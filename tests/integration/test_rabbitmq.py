"""RabbitMQ as the broker while run state, events and cancel stay in Redis.

The core flow — a run fanning out to two machines, a ui cancel — and a machine killed
mid-call, which RabbitMQ hands back at once when the dead consumer's connection drops
(there is no visibility timeout on AMQP; the Redis transport options are not sent).

Skipped when RabbitMQ is unreachable, unless `CI` is set: in CI it must run. Queues
are shared on the broker, so the machines get names unique to this module; the
coordinator queue's name is fixed by the contract, so two test sessions against the
same RabbitMQ at once would take each other's turn messages.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import amqp
import pytest

from cmdop_worker.celery_app import broker_transport_options, create_app
from cmdop_worker.config import Settings
from cmdop_worker.messages import Outgoing, publish
from cmdop_worker.models import TERMINAL_EVENTS
from cmdop_worker.state.keys import CONTINUATION_QUEUE, Keys
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.procs import sleeper, ui_cancel_stops, wait_for_sleeper

from ..conftest import repo_root

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]

BROKER_URL = os.environ.get("CMDOP_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
SUFFIX = uuid.uuid4().hex[:8]
A, B = f"rmq-{SUFFIX}-a", f"rmq-{SUFFIX}-b"


def rabbitmq_reachable(host: str = "127.0.0.1", port: int = 5672) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_rabbitmq() -> None:
    if not rabbitmq_reachable():
        if os.environ.get("CI"):
            pytest.fail("RabbitMQ is not reachable at 127.0.0.1:5672 and CI is set")
        pytest.skip("RabbitMQ is not reachable at 127.0.0.1:5672")


@pytest.fixture(scope="module")
def rabbit_fleet(
    redis_server: RedisServer, fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalFleet, Settings]]:
    require_rabbitmq()
    env = {
        "CMDOP_REDIS_URL": redis_server.url,
        "CMDOP_BROKER_URL": BROKER_URL,
        "ANTHROPIC_BASE_URL": fake_model.url,
        "ANTHROPIC_API_KEY": "sk-test-secret-do-not-leak",
        "CMDOP_PERMISSION_MODE": "bypass",
        "CMDOP_POLICY_FILE": str(repo_root() / "tests" / "writable_tmp.toml"),
        "CMDOP_PRESENCE_TTL_S": "2",
        "CMDOP_PRESENCE_REFRESH_S": "0.5",
        "CMDOP_WATCHDOG_INTERVAL_S": "0.05",
        "CMDOP_WORKER_CONCURRENCY": "4",
        "CMDOP_TOOL_ENV": "CMDOP_TEST_MACHINE_MARK",
    }
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("rabbit-logs"))
    try:
        fleet.start_coordinator()
        for machine in (A, B):
            fleet.start_machine(machine, {"CMDOP_TEST_MACHINE_MARK": f"mark-{machine}"})
        fleet.wait_ready((A, B), timeout_s=60)
        yield fleet, Settings(redis_url=redis_server.url, broker_url=BROKER_URL)
    finally:
        fleet.stop()


@pytest.fixture
def rabbit_client(rabbit_fleet: tuple[LocalFleet, Settings]) -> Iterator[Client]:
    with Client(rabbit_fleet[1]) as client:
        yield client


def call(machine: str, command: str) -> dict[str, object]:
    return {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": machine, "command": command},
    }


def test_redis_transport_options_are_not_sent_to_rabbitmq() -> None:
    assert broker_transport_options(Settings(broker_url=BROKER_URL)) == {}
    assert "visibility_timeout" in broker_transport_options(Settings())
    confirming = Settings(broker_url=BROKER_URL, broker_confirm_publish=True)
    assert broker_transport_options(confirming) == {"confirm_publish": True}


class Publishes:
    """Every AMQP publish of this process: the channel it went on; and how many waited
    for their own confirm."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.channels: list[int] = []
        self.confirm_waits = 0
        publish_now, confirmed = amqp.Channel._basic_publish, amqp.Channel.basic_publish_confirm

        def spied(channel: amqp.Channel, *args: Any, **kwargs: Any) -> Any:
            self.channels.append(channel.channel_id)
            return publish_now(channel, *args, **kwargs)

        def waits(channel: amqp.Channel, *args: Any, **kwargs: Any) -> Any:
            self.confirm_waits += 1
            return confirmed(channel, *args, **kwargs)

        # Patched before any channel is made: a confirming one binds its publish then.
        for name in ("_basic_publish", "basic_publish"):
            monkeypatch.setattr(amqp.Channel, name, spied)
        monkeypatch.setattr(amqp.Channel, "basic_publish_confirm", waits)


def drain(channel: Any, queue: str, count: int) -> list[Any]:
    got: list[Any] = []
    give_up = time.monotonic() + 20
    while len(got) < count and time.monotonic() < give_up:
        message = channel.basic_get(queue, no_ack=True)
        if message is None:
            time.sleep(0.02)
        else:
            got.append(message)
    return got


@pytest.mark.parametrize("confirms", [False, True], ids=["unconfirmed", "confirmed"])
def test_a_fan_out_goes_out_on_one_channel_without_a_wait_per_message(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, confirms: bool
) -> None:
    require_rabbitmq()
    settings = Settings(
        redis_url=redis_server.url, broker_url=BROKER_URL, broker_confirm_publish=confirms
    )
    app, queue = create_app(settings), f"rmq-{SUFFIX}-publish-{uuid.uuid4().hex[:8]}"
    messages = [
        Outgoing("test.echo", queue, f"{queue}.{n}", [n], headers={"traceparent": f"tp-{n}"})
        for n in range(6)
    ]
    spy = Publishes(monkeypatch)
    try:
        publish(messages, via=app)
        fan_out = list(spy.channels)
        publish([Outgoing("test.echo", queue, f"{queue}.alone", [6])], via=app)
        with app.connection_for_read() as connection:
            channel = connection.default_channel
            got = drain(channel, queue, 7)
            channel.queue_delete(queue)
            channel.exchange_delete(queue)
    finally:
        app.close()
    assert len(fan_out) == 6 and len(set(fan_out)) == 1
    # Only the lone message waited for its own confirm, and only when confirms are on.
    assert spy.confirm_waits == (1 if confirms else 0)
    headers = [m.properties["application_headers"] for m in got]
    assert [(h["id"], h.get("traceparent")) for h in headers] == [
        *((m.task_id, m.headers and m.headers["traceparent"]) for m in messages),
        (f"{queue}.alone", None),
    ]
    assert all(h["task"] == "test.echo" and h["lang"] == "py" for h in headers)


def test_a_fan_out_run_over_rabbitmq(rabbit_client: Client, rabbit_fleet, script) -> None:
    del rabbit_fleet  # running: the machines answer from it
    prompt = script(
        [
            [
                call(A, "echo from-a $CMDOP_TEST_MACHINE_MARK"),
                call(B, "echo from-b $CMDOP_TEST_MACHINE_MARK"),
            ],
            [call(A, "echo again-a"), call(B, "echo again-b")],
            [{"type": "text", "text": "{{results}}"}],
        ]
    )
    run = rabbit_client.submit(prompt=prompt, timeout_s=60)
    events = list(run.events(idle_timeout_s=30))
    result = run.wait(timeout=10)
    assert result.status == "done" and result.turns == 3
    assert "again-a" in result.text and "again-b" in result.text
    ends = [e for e in events if e.type == "TOOL_END"]
    assert [e.data["machine"] for e in ends[:2]] and {e.data["machine"] for e in ends} == {A, B}
    assert f"from-a mark-{A}" in " ".join(e.data["output"] for e in ends)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.type for e in events if e.type in TERMINAL_EVENTS] == ["DONE"]


def test_a_ui_cancel_stops_a_run_over_rabbitmq(rabbit_client: Client, script, tmp_path) -> None:
    sleep = sleeper(30)
    prompt = script([[call(A, sleep)], [{"type": "text", "text": "never"}]])
    run = rabbit_client.submit(prompt=prompt, timeout_s=60)
    pid = wait_for_sleeper(sleep, 20)
    ui_cancel_stops(run, pid)  # the tool sleeps 30 s, longer than the checks wait


def test_a_killed_machine_s_call_comes_back_at_once_and_is_not_run_twice(
    rabbit_client: Client, rabbit_fleet, script, tmp_path
) -> None:
    fleet, _ = rabbit_fleet
    effects = tmp_path / "effects"
    prompt = script(
        [
            [call(B, f"echo ran >> {effects}; sleep 3")],
            [{"type": "text", "text": "{{result:0}}"}],
        ]
    )
    run = rabbit_client.submit(prompt=prompt, timeout_s=60)
    give_up = time.monotonic() + 20
    while not effects.exists():  # the call is running on B
        assert time.monotonic() < give_up
        time.sleep(0.05)
    fleet.workers[B].kill()
    fleet.start_machine(B)
    # Redelivered once the new worker consumed (AMQP has no visibility timeout to wait
    # for; the wait would raise WaitTimeout otherwise), and answered "outcome unknown"
    # rather than run again.
    result = run.wait(timeout=30)
    assert "outcome unknown" in result.text
    time.sleep(3.5)
    assert effects.read_text().split() == ["ran"]


def test_a_run_sent_to_the_continuation_queue_is_refused_over_rabbitmq(
    rabbit_client: Client, rabbit_fleet, script
) -> None:
    """The coordinator takes the queue from the consumer the broker delivered to."""
    fleet, settings = rabbit_fleet
    log = fleet.workers["coordinator"].log_path
    refused = "refused a message for task 'cmdop.run' that arrived on cmdop.coordinator.next"
    before = log.read_text(errors="replace").count(refused)
    run_id = f"forged{uuid.uuid4().hex[:10]}"
    prompt = script([[{"type": "text", "text": "never asked"}]])
    request = {"prompt": prompt, "run_id": run_id}
    create_app(settings).send_task(
        "cmdop.run", kwargs={"request": request}, queue=CONTINUATION_QUEUE, task_id=run_id
    )
    give_up = time.monotonic() + 60
    while log.read_text(errors="replace").count(refused) == before:
        assert not rabbit_client.redis.exists(Keys().state(run_id)), "the forged run started"
        assert time.monotonic() < give_up, "the forged run was never refused"
        time.sleep(0.1)
    assert not rabbit_client.redis.exists(Keys().state(run_id))
