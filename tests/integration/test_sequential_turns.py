"""A sequential turn through real workers: each call's time counts from its sending,
and an operation cancel starts none of the calls still to come.

A machine of this module's own, `seq-asker`, asks a person about every call but
`echo free…` and `sleep …` (its wait for an answer: 9 s). Each test fails on the code
before these fixes: a call after a parked one was sent with the deadline planned at
dispatch, long past once a person had answered, and ran for a millisecond; the turn's
deadline entry, planned at dispatch too, answered a later call "lost" while it ran; a
machine ran a call that reached it past its deadline for a millisecond instead of
refusing it; and after an operation cancel the calls still queued were sent and ran.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.celery_app import create_app
from cmdop_worker.coordinator.runs import initial_state
from cmdop_worker.core.intake import parse_request
from cmdop_worker.models import Event, Message, ToolCall
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.keys import machine_queue
from cmdop_worker.state.sent import mark_sent
from cmdop_worker.state.store import PendingCall
from cmdop_worker.surfaces.client import Client, Run
from tests.procs import wait_for

pytestmark = pytest.mark.integration

ASKER = "seq-asker"
POLICY = """
mode = "default"
[rules]
allow = ["execute_command(echo free*)", "execute_command(sleep *)"]
[sandbox]
writable = ["/tmp"]
approved_writable = ["/tmp"]
"""
DONE = [{"type": "text", "text": "finished"}]


@pytest.fixture(scope="module", autouse=True)
def asker(fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    policy = tmp_path_factory.mktemp("seq") / "policy.toml"
    policy.write_text(POLICY)
    extra = {
        "CMDOP_PERMISSION_MODE": "default",
        "CMDOP_POLICY_FILE": str(policy),
        "CMDOP_APPROVAL_TIMEOUT_S": "9",
    }
    fleet.start_machine(ASKER, extra)
    try:
        fleet.wait_ready(["alpha", ASKER], timeout_s=60)
        yield
    finally:
        fleet.workers.pop(ASKER).stop()


def command(machine: str, line: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": machine, "command": line, **extra},
    }


def first_approval_request(run: Run[Any]) -> Event:
    for event in run.events(idle_timeout_s=60):
        assert not event.is_terminal, event
        if event.type == "APPROVAL_REQUEST":
            return event
    raise AssertionError("no approval request")


def ended(run: Run[Any]) -> tuple[str, dict[str, dict[str, Any]], list[Event]]:
    """The run's status, its TOOL_ENDs' data by call, in call order, and all its events,
    checking each TOOL_END has exactly one TOOL_START before it."""
    result = run.wait(timeout=60, raise_on_failure=False)
    events = run.client.events_so_far(run.run_id)
    starts: list[str] = []
    ends: dict[str, dict[str, Any]] = {}
    for event in events:
        if event.type == "TOOL_START":
            starts.append(event.data["tool_call_id"])
        elif event.type == "TOOL_END":
            call_id = event.data["tool_call_id"]
            assert call_id in starts and call_id not in ends, event
            ends[call_id] = event.data
    assert sorted(starts) == sorted(ends), (starts, ends)
    return result.status, ends, events


# -- a call's time counts from when it is sent -------------------------------------------


def test_a_call_after_a_parked_one_gets_its_own_time_once_sent(client: Client, script) -> None:
    calls = [
        command(ASKER, "echo first", timeout_ms=1000),
        command(ASKER, "echo free second", timeout_ms=1000),
    ]
    run = client.submit(prompt=script([calls, DONE]), parallel_tools=False)
    request = first_approval_request(run)
    # Past both calls' timeouts as planned at dispatch: the person's wait eats neither.
    time.sleep(3.0)
    run.approve(request.data["tool_call_id"], by="ann")
    status, ends, _ = ended(run)
    assert status == "done"
    first, second = ends.values()
    assert first["status"] == "ok", first
    assert second["status"] == "ok" and "second" in second["output"], second


def test_a_call_after_a_parked_one_runs_past_the_turns_deadline_as_planned(
    client: Client, script
) -> None:
    """The turn's deadline, planned at dispatch as the sum of the calls' timeouts (1 s
    + 8 s, and 1.5 s of grace) and pushed by the parked call to its expiry and its own
    deadline, must also be pushed past the deadline of the call sent after it."""
    calls = [
        command(ASKER, "echo first", timeout_ms=1000),
        command(ASKER, "sleep 5", timeout_ms=8000),
    ]
    run = client.submit(prompt=script([calls, DONE]), parallel_tools=False)
    request = first_approval_request(run)
    time.sleep(7.0)  # within the 9 s the machine waits for an answer
    run.approve(request.data["tool_call_id"], by="ann")
    status, ends, _ = ended(run)
    assert status == "done"
    first, second = ends.values()
    assert first["status"] == "ok", first
    assert second["status"] == "ok", second


def test_a_machine_never_starts_a_call_that_reached_it_past_its_deadline(
    rt: Runtime, client: Client, script, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    call_id = f"toolu_late_{uuid.uuid4().hex[:8]}"
    use = command("alpha", f"echo ran > {marker}") | {"id": call_id}
    prompt = script([DONE, [{"type": "text", "text": "got: {{result:0}}"}]])
    state = initial_state(rt, parse_request({"prompt": prompt}), f"late-{uuid.uuid4().hex[:10]}")
    assert rt.store.create(state)
    pending = PendingCall(
        tool_use_id=call_id, tool="execute_command", machine="alpha", deadline_ms=now_ms() + 60_000
    )
    history = [*state.history, Message(role="assistant", content=[use])]
    turn = state.model_copy(update={"turn": 1, "history": history, "awaiting": [pending]})
    rt.store.open_turn(state.run_id, 1, 1, save=turn)
    # The call as a machine gets it when it waited in its queue past its deadline.
    late = ToolCall(
        run_id=state.run_id,
        turn=1,
        tool_use_id=call_id,
        tool="execute_command",
        machine="alpha",
        input=use["input"],
        deadline_ms=now_ms() - 1_000,
        run_deadline_ms=state.deadline_ms,
    )
    mark_sent(rt.redis, rt.keys, [late], ttl_s=60)  # as the coordinator records it
    create_app(client.settings).send_task(
        "cmdop.tool", kwargs={"call": late.model_dump(mode="json")}, queue=machine_queue("alpha")
    )
    outcome = wait_for(lambda: rt.store.outcome(state.run_id, 1, call_id), 30, "an outcome")
    assert (outcome.status, outcome.output) == ("timeout", "not started before its deadline")
    assert not marker.exists()
    status, ends, _ = ended(client.run(state.run_id))
    assert status == "done"
    assert ends[call_id]["status"] == "timeout"


# -- an operation cancel starts no further call ------------------------------------------


def test_an_operation_cancel_starts_none_of_the_calls_still_queued(
    client: Client, script, tmp_path: Path
) -> None:
    markers = [tmp_path / "two", tmp_path / "three"]
    calls = [
        command("alpha", "sleep 1.5; echo one"),
        command("alpha", f"echo two > {markers[0]}"),
        command("beta", f"echo three > {markers[1]}"),
    ]
    prompt = script([calls, DONE])
    run = client.submit(prompt=prompt, parallel_tools=False)
    for event in run.events(idle_timeout_s=60):
        assert not event.is_terminal, event
        if event.type == "TOOL_START":
            assert run.cancel(ui=False, reason="wrap up")
            break
    status, ends, events = ended(run)
    assert status == "cancelled"
    assert events[-1].type == "CANCELLED" and events[-1].data["channel"] == "operation"
    first, *rest = ends.values()
    assert first["status"] == "ok" and "one" in first["output"], first  # it was running
    for end in rest:
        assert (end["status"], end["output"]) == (
            "cancelled",
            "cancelled (wrap up) before it started",
        )
    assert not any(m.exists() for m in markers)
    assert len(script.requests_for(prompt)) == 1  # no model call after the cancel


def test_an_operation_cancel_of_a_parked_call_starts_none_after_it(client: Client, script) -> None:
    calls = [command(ASKER, "echo first"), command(ASKER, "echo free second")]
    run = client.submit(prompt=script([calls, DONE]), parallel_tools=False)
    first_approval_request(run)
    assert run.cancel(ui=False, reason="wrap up")
    status, ends, _ = ended(run)
    assert status == "cancelled"
    first, second = ends.values()
    assert (first["status"], first["output"]) == (
        "cancelled",
        "cancelled while waiting for approval",
    )
    assert (second["status"], second["output"]) == (
        "cancelled",
        "cancelled (wrap up) before it started",
    )
