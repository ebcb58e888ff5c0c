"""A machine worker's guards on a `cmdop.tool` message sent to it directly: a call
addressed to another machine, a call cancelled before it starts, and a redelivered
call that already has an outcome run nothing."""

from __future__ import annotations

import time
import uuid

import pytest

from cmdop_worker.celery_app import create_app
from cmdop_worker.models import CancelRequest, ToolCall, ToolOutcome
from cmdop_worker.runtime import now_ms
from cmdop_worker.state.keys import machine_queue
from cmdop_worker.state.sent import mark_sent
from cmdop_worker.state.store import Recorded
from cmdop_worker.surfaces.client import Client
from tests.procs import wait_for

pytestmark = pytest.mark.integration


def test_a_worker_refuses_a_call_addressed_to_another_machine(client, fleet, tmp_path) -> None:
    run_id = f"misaddressed-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "must-not-exist"
    client.store.open_turn(run_id, 1, 1)
    call = ToolCall(
        run_id=run_id,
        turn=1,
        tool_use_id="toolu_misaddressed",
        tool="execute_command",
        machine="beta",
        input={"machine": "beta", "command": f"touch {marker}"},
        deadline_ms=now_ms() + 20_000,
        run_deadline_ms=now_ms() + 20_000,
    )
    app = create_app(client.settings)
    app.send_task(
        "cmdop.tool", kwargs={"call": call.model_dump(mode="json")}, queue=machine_queue("alpha")
    )
    outcome = wait_for(
        lambda: client.store.outcome(run_id, 1, "toolu_misaddressed"), 20, "the refusal"
    )
    assert outcome.status == "invalid"
    assert outcome.output == "call addressed to machine beta reached alpha; refused"
    time.sleep(0.3)
    assert not marker.exists()
    assert not client.store.was_started(run_id, "toolu_misaddressed")


def _send_direct(client: Client, run_id: str, tool_use_id: str, command: str) -> None:
    """A `cmdop.tool` message for machine alpha, as the coordinator sends one."""
    call = ToolCall(
        run_id=run_id,
        turn=1,
        tool_use_id=tool_use_id,
        tool="execute_command",
        machine="alpha",
        input={"machine": "alpha", "command": command},
        deadline_ms=now_ms() + 20_000,
        run_deadline_ms=now_ms() + 20_000,
    )
    mark_sent(client.redis, client.keys, [call], ttl_s=60)  # as the coordinator records it
    create_app(client.settings).send_task(
        "cmdop.tool", kwargs={"call": call.model_dump(mode="json")}, queue=machine_queue("alpha")
    )


def test_a_call_cancelled_from_the_ui_before_it_starts_never_starts(
    client, fleet, tmp_path
) -> None:
    run_id = f"precancel-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "must-not-exist"
    client.store.open_turn(run_id, 1, 1)
    cancel = CancelRequest(channel="ui", reason="test")
    client.redis.set(client.keys.cancel(run_id), cancel.model_dump_json(), ex=60)
    _send_direct(client, run_id, "toolu_precancel", f"touch {marker}")
    outcome = wait_for(lambda: client.store.outcome(run_id, 1, "toolu_precancel"), 20, "it")
    assert (outcome.status, outcome.output) == ("cancelled", "cancelled before it started")
    assert not client.store.was_started(run_id, "toolu_precancel")
    time.sleep(0.3)
    assert not marker.exists()
    # Reported as a call that ended: its TOOL_START, then its TOOL_END, nothing else.
    events = list(client.events(run_id, idle_timeout_s=1))
    assert [(e.type, e.data["status"] if e.type == "TOOL_END" else None) for e in events] == [
        ("TOOL_START", None),
        ("TOOL_END", "cancelled"),
    ]


def test_a_redelivered_call_with_an_outcome_runs_nothing_and_writes_no_event(
    client, fleet, tmp_path
) -> None:
    run_id = f"redelivered-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "must-not-exist"
    client.store.open_turn(run_id, 2, 1)  # turn 1 stays open: no advance to wait for
    first = ToolOutcome(tool_use_id="toolu_again", tool="execute_command", output="first")
    assert client.store.record_outcome(run_id, 1, first)[0] is Recorded.STORED
    _send_direct(client, run_id, "toolu_again", f"touch {marker}")
    _send_direct(client, run_id, "toolu_probe", "true")  # alpha takes calls in order
    wait_for(lambda: client.store.outcome(run_id, 1, "toolu_probe"), 20, "the next call")
    assert not marker.exists()
    assert client.store.outcome(run_id, 1, "toolu_again") == first
    assert not client.store.was_started(run_id, "toolu_again")
    ids = [e.data["tool_call_id"] for e in client.events(run_id, idle_timeout_s=1)]
    assert ids == ["toolu_probe", "toolu_probe"]
