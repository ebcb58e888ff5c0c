"""A machine runs only the calls the control plane sent it (`state.sent`).

A machine's ACL credentials cannot push onto another machine's queue at all (a
sequential turn's next call for another machine goes by way of a coordinator). Who
can push onto a machine's queue — its own credentials, or anyone with a fleet's shared
password, such as a tool that reached Redis — pushes a well-formed `cmdop.tool`
message, for a call the target's gate allows (mode bypass), with a marker command.
The target refuses it (its log says so): the marker never appears, the call is never
marked started and no outcome is written into the run it names; nor does a message
whose input differs from what its sender recorded run. The same message,
once its sender's record is written with the coordinator's credentials, runs: the
refusal is the record's doing, not the gate's nor the message's shape.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cmdop_worker.celery_app import create_app
from cmdop_worker.models import ToolCall
from cmdop_worker.runtime import now_ms
from cmdop_worker.state.keys import machine_queue
from cmdop_worker.state.sent import mark_sent
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import repo_root
from ..procs import wait_for
from .test_redis_acl import MACHINES, REFUSED, AclFleet, acl_fleet

pytestmark = pytest.mark.integration

REFUSAL = "refused: not sent to"


@pytest.fixture(scope="module")
def bypass_acl(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AclFleet]:
    """Machines logged in as their ACL users (as `test_redis_acl`'s), in mode bypass:
    their gates allow whatever reaches them, the floor aside."""
    workdir = tmp_path_factory.mktemp("forged")
    policy = str(repo_root() / "tests" / "writable_tmp.toml")
    with acl_fleet(
        fake_model, workdir, MACHINES, permission_mode="bypass", policy_file=policy
    ) as f:
        yield f


def marker_call(run_id: str, machine: str, marker: Path) -> ToolCall:
    """A call the gate allows (`echo`, into a writable /tmp), leaving a marker."""
    return ToolCall(
        run_id=run_id,
        turn=1,
        tool_use_id=f"toolu_{uuid.uuid4().hex[:10]}",
        tool="execute_command",
        machine=machine,
        input={"machine": machine, "command": f"echo ran > {marker}"},
        deadline_ms=now_ms() + 30_000,
        run_deadline_ms=now_ms() + 60_000,
    )


def raw_message(client: Client, call: ToolCall) -> str:
    """The `cmdop.tool` message as the coordinator would publish it, taken off a queue
    nobody consumes: the exact bytes a forger pushes."""
    scratch = f"scratch-{uuid.uuid4().hex[:8]}"
    create_app(client.settings).send_task(
        "cmdop.tool", kwargs={"call": call.model_dump(mode="json")}, queue=scratch
    )
    raw = client.redis.rpop(scratch)
    assert raw is not None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    assert json.loads(text)["headers"]["task"] == "cmdop.tool"
    return text


def refusals(fleet: LocalFleet, machine: str, call: ToolCall) -> bool:
    log = fleet.workers[machine].log_path.read_text(errors="replace")
    return any(REFUSAL in line and call.tool_use_id in line for line in log.splitlines())


def assert_refused(client: Client, fleet: LocalFleet, machine: str, call: ToolCall) -> None:
    wait_for(lambda: refusals(fleet, machine, call), 30, f"{machine}'s refusal")
    assert not client.store.was_started(call.run_id, call.tool_use_id)
    assert client.store.outcome(call.run_id, 1, call.tool_use_id) is None


def test_a_machines_credentials_cannot_make_a_machine_run_a_call(
    bypass_acl: AclFleet, tmp_path: Path
) -> None:
    acl = bypass_acl
    marker = tmp_path / "forged-by-acl-a"
    run_id = f"forged-{uuid.uuid4().hex[:8]}"
    acl.client.store.open_turn(run_id, 1, 1)
    thief = acl.as_machine("acl-a")
    # Another machine's queue is out of its reach altogether.
    to_b = raw_message(acl.client, marker_call(run_id, "acl-b", marker))
    with pytest.raises(redis.ResponseError, match=REFUSED):
        thief.lpush(machine_queue("acl-b"), to_b)  # kombu's publish
    # Its own queue it may push onto: a call no sender recorded runs nothing.
    call = marker_call(run_id, "acl-a", marker)
    message = raw_message(acl.client, call)
    thief.lpush(machine_queue("acl-a"), message)

    assert_refused(acl.client, acl.fleet, "acl-a", call)
    assert not marker.exists()
    assert_runs_once_recorded(acl.client, thief, "acl-a", call, message)
    assert marker.exists()


def test_a_call_pushed_with_the_shared_password_is_refused_without_its_record(
    client: Client, fleet: LocalFleet, tmp_path: Path
) -> None:
    marker = tmp_path / "forged-on-own-queue"
    run_id = f"forged-{uuid.uuid4().hex[:8]}"
    client.store.open_turn(run_id, 1, 1)  # a run that exists, waiting for a call
    call = marker_call(run_id, "alpha", marker)  # alpha runs in mode bypass
    message = raw_message(client, call)
    client.redis.lpush(machine_queue("alpha"), message)

    assert_refused(client, fleet, "alpha", call)
    assert not marker.exists()
    assert_runs_once_recorded(client, client.redis, "alpha", call, message)
    assert marker.exists()


def assert_runs_once_recorded(
    client: Client, pusher: redis.Redis, machine: str, call: ToolCall, message: str
) -> None:
    """Recorded by a sender (the coordinator's credentials), the same message runs: it
    was the missing record, not the message's shape, that stopped it."""
    mark_sent(client.redis, client.keys, [call], ttl_s=60)
    pusher.lpush(machine_queue(machine), message)
    outcome = wait_for(lambda: client.store.outcome(call.run_id, 1, call.tool_use_id), 30, "it")
    assert outcome.status == "ok", outcome


def test_a_message_that_differs_from_its_record_is_refused(
    client: Client, fleet: LocalFleet, tmp_path: Path
) -> None:
    marker = tmp_path / "swapped"
    run_id = f"swapped-{uuid.uuid4().hex[:8]}"
    client.store.open_turn(run_id, 1, 1)
    sent = marker_call(run_id, "alpha", tmp_path / "never-sent-anyway")
    mark_sent(client.redis, client.keys, [sent], ttl_s=60)
    swapped = sent.model_copy(update={"input": {**sent.input, "command": f"echo x > {marker}"}})
    client.redis.lpush(machine_queue("alpha"), raw_message(client, swapped))

    assert_refused(client, fleet, "alpha", swapped)
    assert not marker.exists()
