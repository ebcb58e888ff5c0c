"""Secure by default.

- A pickled message sent to the coordinator's queue is refused, never unpickled, and
  the coordinator goes on working.
- Redis with a password and with an ACL user works through the URLs alone; the ACL
  user may touch only keys under the fleet's prefix plus Celery's own, so a key written
  anywhere else would fail the run.
- Every key the fleet writes is under the prefix; what Celery and kombu write is listed.
- No secret (the API key, a Redis password) shows in events, results, tool output,
  worker logs or the task arguments Flower is shown (Celery's task events).
- A request cannot switch the permission floor off.
- TLS (`rediss://`) with a self-signed certificate, when redis-server has TLS built in.
"""

from __future__ import annotations

import pickle
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Producer

from cmdop_worker.celery_app import create_app
from cmdop_worker.config import Settings
from cmdop_worker.core.intake import parse_request
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.state.keys import COORDINATOR_QUEUE
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer, self_signed_cert
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

pytestmark = pytest.mark.integration

API_KEY = "sk-test-secret-do-not-leak"
ADMIN_PW = "redis-admin-pw-7f3a2c"
ACL_PW = "acl-user-pw-91c2be"
PREFIX = "tenant1:"
MACHINE = "sec-a"
# What Celery and kombu write on a Redis broker and result backend, under no prefix of
# ours: queue lists (named as the queues), exchange bindings, the unacked-message
# bookkeeping of the visibility timeout, and task results.
CELERY_KEYS = ("_kombu.*", "cmdop.*", "unacked*", "celery-task-meta-*", "*.celery.pidbox*")
SECRETS = (API_KEY, ADMIN_PW, ACL_PW)


class Trap:
    """Creates a file when unpickled: proof that a message was deserialised."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def fleet_env(url: str, fake: FakeAnthropic) -> dict[str, str]:
    return {
        "CMDOP_REDIS_URL": url,
        "CMDOP_KEY_PREFIX": PREFIX,
        "ANTHROPIC_BASE_URL": fake.url,
        "ANTHROPIC_API_KEY": API_KEY,
        "CMDOP_PERMISSION_MODE": "bypass",
        "CMDOP_PRESENCE_TTL_S": "2",
        "CMDOP_PRESENCE_REFRESH_S": "0.5",
        "CMDOP_WATCHDOG_INTERVAL_S": "0.05",
        "CMDOP_WORKER_CONCURRENCY": "4",
        "CMDOP_TASK_EVENTS": "true",  # every task event there can be, to search for secrets
    }


@pytest.fixture(scope="module")
def secured(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RedisServer, LocalFleet]]:
    """Redis with a password for the default user and an ACL user limited to the
    fleet's keys; the coordinator logs in with the password, the machine as the user."""
    acl = ["--user", "cmdop", "on", f">{ACL_PW}", f"~{PREFIX}*"]
    acl += [f"~{pattern}" for pattern in CELERY_KEYS] + ["&*", "+@all", "-@dangerous"]
    server = RedisServer(password=ADMIN_PW, extra_args=acl).start()
    env = fleet_env(server.url, fake_model)
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("secure-logs"))
    try:
        fleet.start_coordinator()
        fleet.start_machine(MACHINE, {"CMDOP_REDIS_URL": server.url_for("cmdop", ACL_PW)})
        fleet.wait_ready([MACHINE], timeout_s=60)
        yield server, fleet
    finally:
        fleet.stop()
        server.stop()


def run_script(client: Client, fake: FakeAnthropic, turns: list[Any], **fields: Any) -> Any:
    name = f"sec{uuid.uuid4().hex[:10]}"
    fake.add_script(name, turns)
    return client.submit(prompt=f"[[script:{name}]] go", timeout_s=60, **fields)


def capture_task_events(app: Any, seen: list[dict[str, Any]], stop: threading.Event) -> None:
    """What Flower would be shown: every task event on the broker."""
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": seen.append})
        while not stop.is_set():
            try:
                receiver.capture(limit=None, timeout=0.5, wakeup=False)
            except TimeoutError:
                continue


def test_password_and_acl_user_urls_run_a_fleet_that_keeps_secrets(
    secured: tuple[RedisServer, LocalFleet], fake_model: FakeAnthropic
) -> None:
    server, fleet = secured
    settings = Settings(redis_url=server.url, key_prefix=PREFIX, task_events=True)
    app = create_app(settings)
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    listener = threading.Thread(target=capture_task_events, args=(app, seen, stop), daemon=True)
    listener.start()
    time.sleep(0.5)
    with Client(settings, celery_app=app) as client:
        run = run_script(
            client,
            fake_model,
            [
                [
                    {
                        "type": "tool_use",
                        "name": "execute_command",
                        "input": {"machine": MACHINE, "command": "env; echo $ANTHROPIC_API_KEY"},
                    }
                ],
                [{"type": "text", "text": "the environment was: {{result:0}}"}],
            ],
        )
        result = run.wait(timeout=30)
        events = list(run.events(idle_timeout_s=5))
    time.sleep(0.5)
    stop.set()
    listener.join(timeout=5)

    assert result.status == "done"
    assert "PATH=" in result.text  # the tool really printed its environment ...
    assert "CMDOP_REDIS_URL=" not in result.text  # ... which is built, not the worker's
    task_events = [e for e in seen if e.get("type", "").startswith("task-")]
    assert {e["type"] for e in task_events} >= {"task-sent", "task-received", "task-succeeded"}
    tool_args = [e for e in task_events if e.get("name") == "cmdop.tool" and "kwargs" in e]
    assert tool_args and all("'input'" not in e["kwargs"] for e in tool_args), tool_args
    places = {
        "events": "\n".join(e.model_dump_json() for e in events),
        "result": result.model_dump_json(),
        "task events": repr(seen),
        "worker logs": "\n".join(
            w.log_path.read_text(errors="replace") for w in fleet.workers.values()
        ),
    }
    for place, text in places.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} leaked into {place}"
    assert "redis://" not in result.text  # no Redis URL reaches a tool, masked or not


def test_every_key_we_write_is_under_the_prefix(secured: tuple[RedisServer, LocalFleet]) -> None:
    server, _ = secured
    admin = Client(Settings(redis_url=server.url, key_prefix=PREFIX)).redis
    keys = sorted(admin.scan_iter(count=1000))
    ours = [k for k in keys if k.startswith(PREFIX)]
    theirs = [k for k in keys if not k.startswith(PREFIX)]
    print(f"\n[keys] {len(ours)} under {PREFIX!r}; Celery/kombu wrote: {theirs}")
    assert ours
    patterns = [re.compile(p.replace(".", r"\.").replace("*", ".*")) for p in CELERY_KEYS]
    assert all(any(p.fullmatch(k) for p in patterns) for k in theirs), theirs


def test_the_acl_user_cannot_touch_keys_outside_the_prefix(
    secured: tuple[RedisServer, LocalFleet],
) -> None:
    import redis

    server, _ = secured
    user = redis.Redis.from_url(server.url_for("cmdop", ACL_PW))
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set("elsewhere:key", "1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.flushall()
    user.set(f"{PREFIX}probe", "1", ex=5)
    user.close()


def test_a_pickled_message_is_refused_and_the_coordinator_keeps_working(
    client, fleet, fleet_env, script, tmp_path
) -> None:
    trap = tmp_path / "unpickled"
    run_id = f"pickle-{uuid.uuid4().hex[:10]}"
    log = fleet.workers["coordinator"].log_path
    before = log.stat().st_size
    body = ((), {"request": {"prompt": Trap(trap), "run_id": run_id}}, {})
    assert b"\x02io\x94\x8c\x04open" in pickle.dumps(body)  # unpickling it calls open()
    with Connection(fleet_env["CMDOP_REDIS_URL"]) as conn:
        Producer(conn.channel(), exchange=Exchange("")).publish(
            body,
            routing_key=COORDINATOR_QUEUE,
            serializer="pickle",
            headers={"lang": "py", "task": "cmdop.run", "id": run_id, "argsrepr": "()"},
        )
    give_up = time.monotonic() + 15
    while "untrusted content" not in log.read_text(errors="replace")[before:]:
        assert time.monotonic() < give_up, "the coordinator never saw the pickled message"
        time.sleep(0.1)
    assert not trap.exists()
    assert client.redis.exists(client.keys.state(run_id)) == 0
    prompt = script([[{"type": "text", "text": "still serving"}]])
    assert client.submit(prompt=prompt).wait(timeout=20).text == "still serving"
    assert fleet.workers["coordinator"].alive()


def test_session_worker_logs_hold_no_api_key(fleet, client, script) -> None:
    prompt = script([[{"type": "text", "text": "hello"}]])
    client.submit(prompt=prompt).wait(timeout=20)
    for name, worker in fleet.workers.items():
        assert API_KEY not in worker.log_path.read_text(errors="replace"), name


@pytest.mark.parametrize("field", ["permission_mode", "bypass_permissions", "policy"])
def test_a_request_cannot_switch_the_permission_floor_off(field) -> None:
    with pytest.raises(InvalidRequest, match=field):
        parse_request({"prompt": "rm -rf /", field: "bypass"})


def test_a_bypass_request_is_refused_by_the_fleet(client) -> None:
    app = create_app(client.settings)
    task = app.send_task(
        "cmdop.run",
        kwargs={"request": {"prompt": "hi", "permission_mode": "bypass", "run_id": "bypass-1"}},
        queue=COORDINATOR_QUEUE,
    )
    with pytest.raises(Exception, match="permission_mode"):
        task.get(timeout=20)
    assert client.redis.exists(client.keys.state("bypass-1")) == 0


def test_tls_redis_works_through_a_rediss_url(fake_model: FakeAnthropic, tmp_path: Path) -> None:
    try:
        tls = self_signed_cert(tmp_path)
        server = RedisServer(tls=tls, password=ADMIN_PW).start(timeout_s=5)
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"no TLS-capable redis-server or openssl here: {exc}")
    fleet = LocalFleet(fleet_env(server.url, fake_model), logdir=tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    try:
        fleet.start_coordinator()
        fleet.start_machine(MACHINE)
        fleet.wait_ready([MACHINE], timeout_s=60)
        with Client(Settings(redis_url=server.url, key_prefix=PREFIX)) as client:
            run = run_script(
                client,
                fake_model,
                [
                    [
                        {
                            "type": "tool_use",
                            "name": "execute_command",
                            "input": {"machine": MACHINE, "command": "echo over tls"},
                        }
                    ],
                    [{"type": "text", "text": "{{result:0}}"}],
                ],
            )
            assert "over tls" in run.wait(timeout=30).text
    finally:
        fleet.stop()
        server.stop()
