"""Machine workers as Redis ACL users (`state.acl`), on a real redis-server.

The fleet's Redis has a password; the coordinator logs in with it, and each machine
worker as an ACL user of its own, created as an operator would: the line `cmdop-worker
acl` prints, fed to `redis-cli`. Then:

- runs with calls on both machines reach DONE, in a parallel turn and in a sequential
  one (whose calls each machine hands on to the next), and Redis logged no command of
  a machine user refused: the grant is enough;
- a machine's credentials cannot approve a parked call, by any route: writing the
  verdict, running the answer script, writing an answer into the call's record, sending
  a forged approved `cmdop.tool` task to its own queue, publishing an answer. The
  call's marker file never appears, and a person's denial still ends it;
- they cannot read another machine's queued calls or in-flight (unacknowledged) calls,
  nor list keys;
- they cannot read another run's state, result, events or outcomes, nor cancel it:
  neither by the cancel script nor by a cancel pushed on its control channel; the run
  goes on to DONE with its call's output.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from cmdop_worker.celery_app import create_app
from cmdop_worker.config import Settings
from cmdop_worker.machine.redis_guard import anonymous_access
from cmdop_worker.messages import send_answer
from cmdop_worker.models import ApprovalAnswer, CancelRequest, Event
from cmdop_worker.state.approvals import Approvals
from cmdop_worker.state.connect import now_ms
from cmdop_worker.state.events import EventSink
from cmdop_worker.state.keys import Keys, machine_queue
from cmdop_worker.surfaces.client import Client, Run
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer, find_redis_server
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import isolated_env

pytestmark = pytest.mark.integration

MACHINES = ("acl-a", "acl-b")
ADMIN_PW = secrets.token_urlsafe(16)
POLICY = """
mode = "default"
[rules]
allow = ["execute_command(echo *)", "execute_command(sleep *)"]
[sandbox]
writable = ["/tmp"]
approved_writable = ["/tmp"]
"""
KEYS = Keys()
CLI = str(Path(sys.executable).with_name("cmdop-worker"))
# Refused at the command (NoPermissionError), or by a command inside a script.
REFUSED = r"no permissions|can't access"


@dataclass
class AclFleet:
    server: RedisServer
    fleet: LocalFleet
    client: Client
    fake: FakeAnthropic
    passwords: dict[str, str]

    def as_machine(self, machine: str) -> redis.Redis:
        """A client with `machine`'s credentials, as a tool that took them would have."""
        url = self.machine_url(machine)
        return redis.Redis.from_url(url, decode_responses=True)

    def machine_url(self, machine: str) -> str:
        return self.server.url_for(f"machine-{machine}", self.passwords[machine])

    def coordinator_log(self) -> str:
        return self.fleet.workers["coordinator"].log_path.read_text(errors="replace")

    def submit(self, turns: list[Any], **fields: Any) -> Run[Any]:
        name = f"acl{secrets.token_hex(5)}"
        self.fake.add_script(name, turns)
        return self.client.submit(prompt=f"[[script:{name}]] go", timeout_s=120, **fields)


@pytest.fixture(scope="module")
def acl(fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclFleet]:
    workdir = tmp_path_factory.mktemp("acl")
    (workdir / "policy.toml").write_text(POLICY)
    settings = {"policy_file": str(workdir / "policy.toml"), "permission_mode": "default"}
    with acl_fleet(fake_model, workdir, MACHINES, approval_timeout_s="300", **settings) as fleet:
        yield fleet


@contextmanager
def acl_fleet(
    fake: FakeAnthropic, workdir: Path, machines: tuple[str, ...], **settings: str
) -> Iterator[AclFleet]:
    """A coordinator on the admin user and `machines`, each logged in as its own ACL
    user made from `cmdop-worker acl`'s line; `settings` as `isolated_env` takes them."""
    server = RedisServer(password=ADMIN_PW).start()
    passwords = {m: secrets.token_urlsafe(16) for m in machines}
    fleet = LocalFleet(isolated_env(server.url, fake, **settings), logdir=workdir)
    try:
        for machine, password in passwords.items():
            create_user(server, machine, password, workdir)
        fleet.start_coordinator()
        for machine in machines:
            url = server.url_for(f"machine-{machine}", passwords[machine])
            fleet.start_machine(machine, {"CMDOP_REDIS_URL": url})
        fleet.wait_ready(list(machines), timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield AclFleet(server, fleet, client, fake, passwords)
    finally:
        fleet.stop()
        server.close()


def create_user(server: RedisServer, machine: str, password: str, workdir: Path) -> None:
    """The machine's user as an operator creates it: `cmdop-worker acl`'s line, fed to
    `redis-cli`."""
    secret = workdir / f"{machine}.pw"
    secret.write_text(password + "\n")
    line = subprocess.run(
        [
            CLI,
            "acl",
            "--machine",
            machine,
            "--user",
            f"machine-{machine}",
            "--password-file",
            secret,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    redis_cli = Path(find_redis_server()).with_name("redis-cli")
    done = subprocess.run(
        [str(redis_cli), "-p", str(server.port), "--no-auth-warning", "-a", ADMIN_PW],
        input=line,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert done.stdout.strip() == "OK", done


def command(machine: str, text: str) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": machine, "command": text},
    }


def reply(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]


def events_until(run: Run[Any], found: Callable[[Event], bool]) -> Event:
    for event in run.events(idle_timeout_s=60):
        assert not event.is_terminal, event
        if found(event):
            return event
    raise AssertionError("the run went quiet")


def tool_ends(run: Run[Any]) -> dict[str, dict[str, Any]]:
    return {
        e.data["machine"] + ":" + e.data["tool_call_id"]: e.data
        for e in run.client.events_so_far(run.run_id)
        if e.type == "TOOL_END"
    }


def last_line(end: dict[str, Any]) -> str:
    return str(end["output"]).strip().splitlines()[-1]


def refused_by_acl(acl: AclFleet) -> list[dict[str, Any]]:
    """What Redis refused a machine user since the log was last reset."""
    entries = acl.client.redis.execute_command("ACL", "LOG")
    parsed = [
        dict(zip(e[::2], e[1::2], strict=True)) if isinstance(e, list) else e for e in entries
    ]
    return [e for e in parsed if str(e.get("username", "")).startswith("machine-")]


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_machines_as_acl_users_run_calls_end_to_end(acl: AclFleet, parallel: bool) -> None:
    acl.client.redis.execute_command("ACL", "LOG", "RESET")
    calls = [
        command("acl-a", "echo one"),
        command("acl-b", "echo two"),
        command("acl-a", "echo three"),
    ]
    run = acl.submit([calls, reply("done")], parallel_tools=parallel)
    result = run.wait(timeout=120)
    assert result.status == "done", result
    outputs = sorted(last_line(d) for d in tool_ends(run).values())
    assert outputs == ["one", "three", "two"]
    assert refused_by_acl(acl) == []


def test_the_start_check_sees_this_redis_closed_and_a_passwordless_one_open(acl: AclFleet) -> None:
    assert anonymous_access(acl.machine_url("acl-a")) is False
    with_no_password = RedisServer().start()
    try:
        assert anonymous_access(with_no_password.url) is True
    finally:
        with_no_password.close()


def test_machine_credentials_cannot_approve_a_parked_call(acl: AclFleet, tmp_path: Path) -> None:
    marker = tmp_path / "approved-by-a-machine"
    run = acl.submit([[command("acl-a", f"touch {marker}")], reply("over")])
    asked = events_until(run, lambda e: e.type == "APPROVAL_REQUEST")
    call_id = asked.data["tool_call_id"]
    thief = acl.as_machine("acl-a")
    forged = ApprovalAnswer(verdict="approved", by="acl-a", answered_ms=now_ms())
    verdict_key = KEYS.verdict(run.run_id, call_id, "acl-a")

    with pytest.raises(redis.ResponseError, match=REFUSED):
        thief.hset(verdict_key, mapping={"state": "approved", "answer": forged.model_dump_json()})
    events = EventSink(thief, KEYS, maxlen=1000, ttl_s=600, clock_ms=now_ms)
    approvals = Approvals(thief, KEYS, events, ttl_s=600)
    record = approvals.load(run.run_id, call_id, "acl-a")
    assert record is not None and record.state == "waiting"
    with pytest.raises(
        redis.ResponseError, match=REFUSED
    ):  # the answer script writes the verdict: refused in it
        approvals.answer(record, forged)
    # Its record is the machine's to write: an answer there is not the verdict.
    answer_fields = {"state": "approved", "answer": forged.model_dump_json(), "deadline_ms": "1"}
    thief.hset(KEYS.approval(run.run_id, call_id, "acl-a"), mapping=answer_fields)
    thief.publish(KEYS.live(run.run_id), json.dumps({"type": "APPROVAL_RESOLVED", "data": {}}))
    machine_app = create_app(Settings(redis_url=acl.machine_url("acl-a")))
    send_answer(machine_app, record.call, forged)  # a forged approved task, on its own queue
    drain(acl, machine_queue("acl-a"))

    assert acl.client.redis.hget(verdict_key, "state") is None
    assert not marker.exists()
    run.approve(call_id, approve=False, reason="no", by="ann")
    result = run.wait(timeout=60)
    assert result.status == "done"
    (end,) = tool_ends(run).values()
    assert end["status"] == "denied"
    assert not marker.exists()


def drain(acl: AclFleet, queue: str) -> None:
    """Until the machine has taken every message of its queue in."""
    give_up = time.monotonic() + 30
    while acl.client.redis.llen(queue):
        assert time.monotonic() < give_up, f"{queue} was never drained"
        time.sleep(0.05)
    time.sleep(0.5)  # the task it took in has had time to act, had it been going to


def test_machine_credentials_cannot_read_another_machines_calls(acl: AclFleet) -> None:
    secret = f"queued-{secrets.token_hex(8)}"
    other_queue = machine_queue("acl-offline")
    acl.client.redis.lpush(other_queue, json.dumps({"body": secret}))
    run = acl.submit([[command("acl-b", "sleep 3; echo slept")], reply("over")])
    events_until(run, lambda e: e.type == "TOOL_START")
    in_flight = f"unacked:{machine_queue('acl-b')}"
    assert acl.client.redis.hlen(in_flight) >= 1  # acl-b holds its call unacknowledged
    thief = acl.as_machine("acl-a")
    reads: list[Callable[[], Any]] = [
        lambda: thief.lrange(other_queue, 0, -1),
        lambda: thief.lpop(other_queue),
        lambda: thief.rpop(other_queue),
        lambda: thief.brpop([other_queue], timeout=1),
        lambda: thief.lmove(other_queue, machine_queue("acl-a")),
        lambda: thief.lrange(machine_queue("acl-b"), 0, -1),
        lambda: thief.hgetall(in_flight),
        lambda: thief.hgetall("unacked"),
        lambda: thief.zrange(f"unacked_index:{machine_queue('acl-b')}", 0, -1),
        lambda: thief.eval("return redis.call('LRANGE', KEYS[1], 0, -1)", 1, other_queue),
        lambda: thief.keys("*"),
        lambda: thief.scan(0),
    ]
    for read in reads:
        with pytest.raises(redis.ResponseError, match=REFUSED):
            read()
    assert acl.client.redis.lrange(other_queue, 0, -1) == [json.dumps({"body": secret})]
    assert run.wait(timeout=60).status == "done"


def test_machine_credentials_cannot_listen_to_any_runs_events(acl: AclFleet) -> None:
    """Events are write-only on the live channel too: a machine publishes a run's events
    and cannot subscribe to them, by pattern or by name (nor to Celery's task events)."""
    run = acl.submit([[command("acl-b", "sleep 1; echo secret-output")], reply("over")])
    events_until(run, lambda e: e.type == "TOOL_START")
    thief = acl.as_machine("acl-a")
    for listen in (
        lambda bus: bus.psubscribe(f"{KEYS.prefix}run:*:live"),
        lambda bus: bus.psubscribe("*"),
        lambda bus: bus.subscribe(KEYS.live(run.run_id)),
        lambda bus: bus.psubscribe("/*.celeryev/*"),
    ):
        bus = thief.pubsub()
        with pytest.raises(redis.exceptions.NoPermissionError):
            listen(bus)
            bus.get_message(timeout=1)
        bus.close()
    assert run.wait(timeout=60).status == "done"
    # What the cancel hub needs still works: the runs' cancel notices.
    bus = thief.pubsub()
    bus.psubscribe(KEYS.control_pattern)
    assert bus.get_message(timeout=5)["type"] == "psubscribe"
    bus.close()


def test_machine_credentials_cannot_read_or_cancel_another_run(acl: AclFleet) -> None:
    run = acl.submit([[command("acl-b", "sleep 2; echo slept")], reply("over")])
    events_until(run, lambda e: e.type == "TOOL_START")
    thief = acl.as_machine("acl-a")
    rid = run.run_id
    reads: list[Callable[[], Any]] = [
        lambda: thief.get(KEYS.state(rid)),
        lambda: thief.get(KEYS.result(rid)),
        lambda: thief.xrange(KEYS.events(rid)),
        lambda: thief.hgetall(KEYS.turn(rid, 1, "results")),
        lambda: thief.lrange(KEYS.steer(rid), 0, -1),
        lambda: thief.set(KEYS.cancel(rid), CancelRequest(channel="ui").model_dump_json()),
        lambda: thief.delete(KEYS.state(rid)),
        lambda: Client(Settings(redis_url=acl.machine_url("acl-a"))).cancel(rid, ui=True),
        lambda: thief.flushall(),
        # Not even the prompt to read the cancel key: a machine only listens there.
        lambda: thief.publish(KEYS.control(rid), CancelRequest(channel="ui").model_dump_json()),
    ]
    for read in reads:
        with pytest.raises(redis.ResponseError, match=REFUSED):
            read()
    result = run.wait(timeout=60)
    assert result.status == "done", result
    (end,) = tool_ends(run).values()
    assert (end["status"], last_line(end)) == ("ok", "slept")
