"""A machine's Redis credentials start no run (`arrival`, `state.acl`).

A real fleet on a Redis with a password; the machine workers log in as the ACL users
`cmdop-worker acl` creates. A `cmdop.run` message, made by the fleet's own producer
and changed as an attacker would (its own run id, a prompt whose script calls a tool on
the other machine, a `delivery_info` naming `cmdop.coordinator`), is pushed with a
machine's credentials:

- onto `cmdop.coordinator`: Redis refuses it (NOPERM);
- onto `cmdop.coordinator.next`, the continuation queue machines may push onto: the
  coordinator takes it in and drops it, logging the refusal. No state for its run id
  appears, the model never sees its prompt, the marker its tool would touch never
  appears; and so for Celery's own `celery.map` naming `cmdop.run`.

Runs with calls on both machines still reach DONE: their continuations (next turns,
a sequential turn's hand-ons) go by the continuation queue.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from cmdop_worker.celery_app import create_app
from cmdop_worker.config import Settings
from cmdop_worker.state.keys import CONTINUATION_QUEUE, COORDINATOR_QUEUE, Keys
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..procs import wait_for
from .test_redis_acl import AclFleet, acl_fleet, command, reply

pytestmark = pytest.mark.integration

MACHINES = ("run-a", "run-b")
POLICY = """
mode = "default"
[rules]
allow = ["execute_command(echo *)", "execute_command(touch *)"]
[sandbox]
writable = ["/tmp"]
"""
KEYS = Keys()
REFUSAL = "refused a message for task"


@pytest.fixture(scope="module")
def forging_fleet(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AclFleet]:
    workdir = tmp_path_factory.mktemp("forged-run")
    (workdir / "policy.toml").write_text(POLICY)
    settings = {"policy_file": str(workdir / "policy.toml"), "permission_mode": "default"}
    with acl_fleet(fake_model, workdir, MACHINES, **settings) as fleet:
        yield fleet


def captured(fleet: AclFleet, task: str, **options: Any) -> dict[str, Any]:
    """A message exactly as the fleet's producer makes it, caught in a scratch list."""
    scratch = f"scratch.{secrets.token_hex(4)}"
    create_app(Settings(redis_url=fleet.server.url)).send_task(task, queue=scratch, **options)
    (raw,) = fleet.client.redis.lrange(scratch, 0, -1)
    fleet.client.redis.delete(scratch)
    message: dict[str, Any] = json.loads(raw)
    return message


def forged_run(fleet: AclFleet, run_id: str, prompt: str) -> dict[str, Any]:
    message = captured(fleet, "cmdop.run", kwargs={"request": {"prompt": "x"}})
    body = [[], {"request": {"prompt": prompt, "run_id": run_id}}, {}]
    message["body"] = base64.b64encode(json.dumps(body).encode()).decode()
    message["headers"] |= {"id": run_id, "root_id": run_id}
    # The publisher writes delivery_info: the forger says it came by the front door.
    message["properties"]["delivery_info"] = {
        "exchange": COORDINATOR_QUEUE,
        "routing_key": COORDINATOR_QUEUE,
    }
    return message


def tool_script(fleet: AclFleet, marker: Path) -> str:
    name = f"forged{secrets.token_hex(5)}"
    fleet.fake.add_script(name, [[command("run-b", f"touch {marker}")], reply("pwned")])
    return f"[[script:{name}]] start a run from a machine"


def seen_prompts(fleet: AclFleet) -> str:
    return json.dumps(fleet.fake.requests())


def refusals(fleet: AclFleet) -> int:
    return fleet.coordinator_log().count(REFUSAL)


def wait_for_refusal_or_run(fleet: AclFleet, before: int, run_id: str) -> None:
    give_up = time.monotonic() + 60
    while refusals(fleet) == before and not fleet.client.redis.exists(KEYS.state(run_id)):
        assert time.monotonic() < give_up, "the forged message was neither refused nor run"
        time.sleep(0.1)
    time.sleep(1.0)  # had it been run, its turn has had time to reach the model


def assert_never_ran(fleet: AclFleet, run_id: str, prompt: str, marker: Path) -> None:
    assert not fleet.client.redis.exists(KEYS.state(run_id))
    assert not fleet.client.redis.exists(KEYS.events(run_id))
    assert prompt not in seen_prompts(fleet)
    assert not marker.exists()


def test_machine_credentials_cannot_push_onto_the_coordinator_queue(
    forging_fleet: AclFleet, tmp_path: Path
) -> None:
    run_id = f"forged{secrets.token_hex(6)}"
    marker = tmp_path / "started-by-a-machine"
    prompt = tool_script(forging_fleet, marker)
    thief = forging_fleet.as_machine("run-a")
    with pytest.raises(redis.exceptions.NoPermissionError):
        thief.lpush(COORDINATOR_QUEUE, json.dumps(forged_run(forging_fleet, run_id, prompt)))
    assert forging_fleet.client.redis.llen(COORDINATOR_QUEUE) == 0
    assert_never_ran(forging_fleet, run_id, prompt, marker)


@pytest.mark.parametrize("via", ["cmdop.run", "celery.map"])
def test_a_run_pushed_onto_the_continuation_queue_is_refused(
    forging_fleet: AclFleet, tmp_path: Path, via: str
) -> None:
    run_id = f"forged{secrets.token_hex(6)}"
    marker = tmp_path / "started-by-a-machine"
    prompt = tool_script(forging_fleet, marker)
    message = forged_run(forging_fleet, run_id, prompt)
    if via == "celery.map":  # Celery's own task, which calls the task it is given
        message = mapped(forging_fleet, run_id, prompt)
    before = refusals(forging_fleet)
    forging_fleet.as_machine("run-a").lpush(CONTINUATION_QUEUE, json.dumps(message))
    wait_for_refusal_or_run(forging_fleet, before, run_id)
    assert_never_ran(forging_fleet, run_id, prompt, marker)
    assert refusals(forging_fleet) == before + 1
    assert f"'{via}' that arrived on {CONTINUATION_QUEUE}" in forging_fleet.coordinator_log()


@pytest.mark.parametrize("follow_up", ["callbacks", "chain"])
def test_a_continuation_carrying_a_run_to_start_after_it_is_refused(
    forging_fleet: AclFleet, tmp_path: Path, follow_up: str
) -> None:
    """A `cmdop.turn` for no run at all ends at once; Celery would then send what its
    callbacks or chain hold: here, a run."""
    run_id = f"forged{secrets.token_hex(6)}"
    marker = tmp_path / "started-after-a-continuation"
    prompt = tool_script(forging_fleet, marker)
    message = captured(forging_fleet, "cmdop.turn", args=[f"norun{secrets.token_hex(4)}", 1])
    args, kwargs, embed = json.loads(base64.b64decode(message["body"]))
    request = {"prompt": prompt, "run_id": run_id}
    start = {"task": "cmdop.run", "args": [], "kwargs": {"request": request}, "options": {}}
    embed[follow_up] = [start | {"subtask_type": None, "immutable": True}]
    message["body"] = base64.b64encode(json.dumps([args, kwargs, embed]).encode()).decode()
    before = refusals(forging_fleet)
    forging_fleet.as_machine("run-a").lpush(CONTINUATION_QUEUE, json.dumps(message))
    wait_for_refusal_or_run(forging_fleet, before, run_id)
    assert_never_ran(forging_fleet, run_id, prompt, marker)
    assert refusals(forging_fleet) == before + 1


def test_a_push_that_is_no_message_stops_no_coordinator(forging_fleet: AclFleet) -> None:
    """kombu raises on a message it cannot read, and the worker stops: it is dropped."""
    thief = forging_fleet.as_machine("run-a")
    for junk in ("x", "123", '"text"', "[]", '{"body": "x"}'):
        thief.lpush(CONTINUATION_QUEUE, junk)
    wait_for(lambda: forging_fleet.client.redis.llen(CONTINUATION_QUEUE) == 0, 30, "the pops")
    name = f"after{secrets.token_hex(5)}"
    forging_fleet.fake.add_script(name, [[command("run-a", "echo still here")], reply("ok")])
    run = forging_fleet.client.submit(prompt=f"[[script:{name}]] go", timeout_s=120)
    assert run.wait(timeout=120).status == "done"
    log = forging_fleet.coordinator_log()
    assert log.count("that is no kombu message") >= 5, log[-2000:]
    assert "Unrecoverable error" not in log


def mapped(fleet: AclFleet, run_id: str, prompt: str) -> dict[str, Any]:
    task = {"task": "cmdop.run", "args": [], "kwargs": {}, "options": {}, "subtask_type": None}
    items = [{"prompt": prompt, "run_id": run_id}]
    message = captured(fleet, "celery.map", args=[task, items])
    message["properties"]["delivery_info"] = {"exchange": "", "routing_key": COORDINATOR_QUEUE}
    return message


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_continuations_still_come_by_the_continuation_queue(
    forging_fleet: AclFleet, parallel: bool
) -> None:
    name = f"ok{secrets.token_hex(5)}"
    calls = [command("run-a", "echo one"), command("run-b", "echo two")]
    forging_fleet.fake.add_script(name, [calls, reply("done")])
    run = forging_fleet.client.submit(
        prompt=f"[[script:{name}]] go", timeout_s=120, parallel_tools=parallel
    )
    assert run.wait(timeout=120).status == "done"
