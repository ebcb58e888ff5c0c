"""A turn's fan-out in one round trip (`messages.publish`) on the Redis broker.

Against the session's real redis-server, with apps built from the fleet's own
configuration: a pipelined message is the message Celery's `apply_async` publishes
(and a lone `send`'s); a real Celery worker consumes and runs pipelined tasks, their
headers intact; the fan-out is one write to Redis however many messages it holds; a
pipeline that failed is sent again, message by message. (RabbitMQ: `test_rabbitmq`.)
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.client
import redis.connection
from celery import Celery

import cmdop_worker.tasks  # noqa: F401  (registers the fleet's tasks, as in every worker)
from cmdop_worker.celery_app import create_app
from cmdop_worker.config import Settings
from cmdop_worker.messages import Outgoing, publish, send, tool_message, turn_message
from cmdop_worker.models import ToolCall
from cmdop_worker.surfaces.fleet import RedisServer, WorkerProcess
from tests.procs import wait_for

from ..conftest import repo_root

pytestmark = pytest.mark.integration

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def unique(what: str) -> str:
    return f"test.publish.{what}.{uuid.uuid4().hex[:10]}"


def tool_call(queue_machine: str, n: int) -> ToolCall:
    return ToolCall(
        run_id="r-publish",
        turn=3,
        tool_use_id=f"toolu_{n}",
        tool="execute_command",
        machine=queue_machine,
        input={"command": f"echo {n}"},
        deadline_ms=1_900_000_000_000,
        run_deadline_ms=1_900_000_000_000,
    )


@pytest.fixture
def broker(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def fleet_app(redis_server: RedisServer, **settings: Any) -> Celery:
    return create_app(Settings(redis_url=redis_server.url, **settings))


def normalized(raw: bytes | str) -> dict[str, Any]:
    """A raw message from a queue, without what differs from one message to the next."""
    message = json.loads(raw)
    for name in ("id", "root_id"):
        assert message["headers"].pop(name)
    for name in ("correlation_id", "delivery_tag"):
        assert message["properties"].pop(name)
    return message


def copies(message: Outgoing, *hows: str) -> list[Outgoing]:
    """`message` once for each of `hows`, each with a task id of its own."""
    return [dataclasses.replace(message, task_id=unique(how)) for how in hows]


@pytest.mark.parametrize("prefix", ["", "pfx-{}:"], ids=["plain", "global_keyprefix"])
@pytest.mark.parametrize("kind", ["tool", "turn"])
def test_a_pipelined_message_is_the_one_apply_async_publishes(
    redis_server: RedisServer, broker: redis.Redis, prefix: str, kind: str
) -> None:
    prefix = prefix.format(uuid.uuid4().hex[:6])
    app = fleet_app(redis_server, broker_key_prefix=prefix)
    queue = unique("format")
    if kind == "tool":
        base = tool_message(tool_call("m", 1), {"traceparent": TRACEPARENT})
    else:
        base = turn_message("r-publish", 4)
    base = dataclasses.replace(base, queue=queue)
    by_apply, by_send, in_batch = copies(base, "apply", "send", "batch")
    # The task's own `apply_async` (a signature would make the arguments a tuple).
    app.tasks[by_apply.task].apply_async(
        args=by_apply.args,
        kwargs=by_apply.kwargs,
        queue=queue,
        task_id=by_apply.task_id,
        headers=by_apply.headers,
        kwargsrepr=by_apply.kwargsrepr,
    )
    send(by_send, via=app)
    other = dataclasses.replace(in_batch, task_id=unique("other"), queue=unique("other"))
    publish([in_batch, other], via=app)

    # kombu's key for the queue, with the prefix; LPUSH: the newest first.
    raws = broker.lrange(f"{prefix}{queue}", 0, -1)[::-1]
    assert len(raws) == 3
    parsed = [json.loads(raw) for raw in raws]
    assert [p["headers"]["id"] for p in parsed] == [
        m.task_id for m in (by_apply, by_send, in_batch)
    ]
    assert normalized(raws[2]) == normalized(raws[0]) == normalized(raws[1])
    assert broker.llen(f"{prefix}{other.queue}") == 1
    body, _, _ = json.loads(base64.b64decode(parsed[2]["body"]))
    assert (body, parsed[2]["headers"]["task"]) == (list(base.args), base.task)
    if kind == "tool":
        assert parsed[2]["headers"]["traceparent"] == TRACEPARENT


class Writes:
    """Counts the commands this thread writes to Redis (a pipeline's are one write)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = redis.connection.AbstractConnection.send_packed_command
        thread = threading.get_ident()

        def counted(conn: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == thread:
                self.count += 1
            return original(conn, *args, **kwargs)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)


def fan_out(machines: list[str], calls: int, coordinator: str) -> list[Outgoing]:
    """A turn of `calls` tool calls over `machines`' queues, and the next turn's task (on
    `coordinator`, a queue standing in for the fleet's)."""
    tools = [tool_message(tool_call(machines[n % len(machines)], n), {}) for n in range(calls)]
    return [*tools, dataclasses.replace(turn_message("r-publish", 4), queue=coordinator)]


def test_a_fan_out_is_one_write_to_redis(
    redis_server: RedisServer, broker: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, coordinator = fleet_app(redis_server), unique("coordinator")
    machines = [f"pub-{uuid.uuid4().hex[:8]}", f"pub-{uuid.uuid4().hex[:8]}"]
    # kombu declares a queue (a write) the first time a connection sends to it.
    publish(fan_out(machines, 2, coordinator), via=app)
    with app.producer_or_acquire() as producer:  # the fleet's configuration batches
        assert producer.supports_batch_publish

    writes = Writes(monkeypatch)
    publish(fan_out(machines, 5, coordinator), via=app)
    assert writes.count == 1
    writes.count = 0
    for message in fan_out(machines, 5, coordinator):  # one by one: a write each
        send(message, via=app)
    assert writes.count == 6
    sizes = [broker.llen(q) for q in (*(f"cmdop.machine.{m}" for m in machines), coordinator)]
    assert sizes == [1 + 3 + 3, 1 + 2 + 2, 3]


@pytest.mark.parametrize("failing", ["pipeline", "declare"])
def test_a_failed_fan_out_is_sent_again_message_by_message(
    redis_server: RedisServer, broker: redis.Redis, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """The connection lost as the pipeline's replies come back (it was carried out: all
    were pushed, unknown to us), or while it is built, as kombu declares a queue new to
    the connection (nothing was pushed): at least once, either way."""
    app, machine, coordinator = fleet_app(redis_server), f"pub-{uuid.uuid4().hex[:8]}", unique("c")
    queue = f"cmdop.machine.{machine}"
    if failing == "pipeline":  # declared: the fan-out's pipeline holds only its LPUSHes
        publish(fan_out([machine], 1, coordinator), via=app)
        broker.delete(queue, coordinator)
    original, failed = redis.client.Pipeline.execute, list[list[str]]()

    def fails_once(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        commands = [str(command[0]).upper() for command, _ in pipe.command_stack]
        if failed or ("LPUSH" in commands) != (failing == "pipeline"):
            return original(pipe, *args, **kwargs)
        failed.append(commands)
        if failing == "pipeline":
            original(pipe, *args, **kwargs)
        raise redis.ConnectionError("lost in the middle of it")

    monkeypatch.setattr(redis.client.Pipeline, "execute", fails_once)
    messages = fan_out([machine], 3, coordinator)
    publish(messages, via=app)
    assert failed
    copies = 2 if failing == "pipeline" else 1
    ids = sorted(json.loads(raw)["headers"]["id"] for raw in broker.lrange(queue, 0, -1))
    assert ids == sorted(m.task_id for m in messages[:3] for _ in range(copies))
    assert broker.llen(coordinator) == copies


@pytest.fixture
def echo_worker(redis_server: RedisServer, tmp_path: Path) -> Iterator[str]:
    """A real Celery worker (the fleet's configuration) consuming one queue of its own."""
    queue = unique("echo")
    argv = [sys.executable, "-m", "celery", "-A", "tests.integration.publish_worker", "worker"]
    argv += ["-Q", queue, "-P", "threads", "-c", "4", "-n", f"{queue}@%h", "--loglevel=INFO"]
    argv += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
    env = {**os.environ, "PYTHONPATH": str(repo_root()), "CMDOP_REDIS_URL": redis_server.url}
    worker = WorkerProcess("echo", argv, env, tmp_path / "echo.log").start()
    try:
        yield queue
    finally:
        worker.stop()


def test_a_worker_runs_every_pipelined_task_with_its_headers(
    redis_server: RedisServer, broker: redis.Redis, echo_worker: str
) -> None:
    app, key = fleet_app(redis_server), unique("seen")
    traceparents = [f"00-{n + 1:032x}-{n + 1:016x}-01" for n in range(6)]
    messages = [
        Outgoing("test.echo", echo_worker, f"{key}.{n}", [key, n], headers={"traceparent": tp})
        for n, tp in enumerate(traceparents)
    ]
    publish(messages, via=app)
    wait_for(lambda: broker.llen(key) >= 6, 30, "the worker running all six tasks")
    seen = sorted((json.loads(raw) for raw in broker.lrange(key, 0, -1)), key=lambda s: s["n"])
    assert [(s["id"], s["n"], s["traceparent"]) for s in seen] == [
        (m.task_id, n, tp) for n, (m, tp) in enumerate(zip(messages, traceparents, strict=True))
    ]
