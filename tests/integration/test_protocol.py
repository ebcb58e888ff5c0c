"""The run protocol's edges: cancel precedence, fenced writes, lease renewal, the order
of a sequential turn, and a TOOL_START for every TOOL_END.

Each test fails on the code before these fixes: a ui cancel was overwritten by a later
operation one; a cancel before the run's state existed was dropped; a holder that lost
its lease still saved, dispatched and ended the run; a renewal failing on a Redis error
counted as renewed forever; coordinator tools ran at once in a sequential turn, and
recovery re-sent a sequential turn's calls all at once; calls answered for the tool
(cancel fill) had a TOOL_END without a TOOL_START.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cmdop_worker.config import Settings
from cmdop_worker.coordinator.calls import read_fleet, start_calls
from cmdop_worker.coordinator.finish import finish_done
from cmdop_worker.coordinator.lease import TurnLease
from cmdop_worker.coordinator.runs import initial_state
from cmdop_worker.core.intake import parse_request
from cmdop_worker.core.results import unanswered_outcome
from cmdop_worker.core.step import Finish, RunTools
from cmdop_worker.errors import LeaseLost
from cmdop_worker.models import CancelRequest, Event, Message
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.fence import fenced
from cmdop_worker.state.keys import advance_member
from cmdop_worker.state.store import PendingCall, RunState
from cmdop_worker.surfaces.client import Client
from tests.harness import TurnHarness
from tests.procs import sleeper, wait_for_sleeper

pytestmark = pytest.mark.integration

DONE = [{"type": "text", "text": "finished"}]


def command(machine: str, line: str, tool_use_id: str | None = None) -> dict[str, Any]:
    block: dict[str, Any] = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": machine, "command": line},
    }
    if tool_use_id:
        block["id"] = tool_use_id
    return block


def tool_order(events: list[Event]) -> list[str]:
    return [
        f"{e.type}:{e.data['tool_call_id']}" for e in events if e.type in ("TOOL_START", "TOOL_END")
    ]


def assert_each_end_has_one_start(events: list[Event]) -> None:
    starts = [e.data["tool_call_id"] for e in events if e.type == "TOOL_START"]
    ends = [e.data["tool_call_id"] for e in events if e.type == "TOOL_END"]
    assert sorted(starts) == sorted(ends) and len(set(ends)) == len(ends), (starts, ends)


def stored_run(rt: Runtime, prompt: str = "hi", **fields: Any) -> RunState:
    run_id = f"proto-{uuid.uuid4().hex[:10]}"
    state = initial_state(rt, parse_request({"prompt": prompt, **fields}), run_id)
    assert rt.store.create(state)
    return state


def read_until(stream: Any, text: str, lines: int = 50) -> None:
    for _ in range(lines):
        line = stream.readline()
        if text in line:
            return
        assert line, f"the CLI ended before printing {text!r}"
    pytest.fail(f"the CLI never printed {text!r}")


def wait_for_cancel_keys(client: Client, count: int) -> None:
    """Wait until `count` runs of this (coordinator-less) database have a cancel key."""
    give_up = time.monotonic() + 10
    while time.monotonic() < give_up:
        if len(list(client.redis.scan_iter(match=client.keys.run("*", "cancel")))) >= count:
            return
        time.sleep(0.05)
    pytest.fail("the CLI's Ctrl-C wrote no cancel request for its queued run")


# -- cancel precedence ------------------------------------------------------------------


def test_a_ui_cancel_is_not_downgraded_by_a_later_operation_cancel(rt) -> None:
    state = stored_run(rt)
    pubsub = rt.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(rt.keys.control(state.run_id))
    ui = CancelRequest(channel="ui", reason="stop button")
    assert rt.store.request_cancel(state.run_id, ui, now_ms=now_ms())
    later = CancelRequest(channel="operation", reason="operator")
    assert rt.store.request_cancel(state.run_id, later, now_ms=now_ms())  # it is cancelling
    assert rt.store.cancel_request(state.run_id) == ui
    # The run's deadline writes its own operation cancel: it must not replace ui either.
    from cmdop_worker.coordinator.watchdog import handle_entry

    handle_entry(rt, f"run:{state.run_id}")
    assert rt.store.cancel_request(state.run_id) == ui
    pushed = []
    give_up = time.monotonic() + 2
    while time.monotonic() < give_up:
        message = pubsub.get_message(timeout=0.1)
        if message is not None:
            pushed.append(CancelRequest.model_validate_json(message["data"]))
    pubsub.close()
    assert pushed == [ui]  # the weaker requests were never pushed


@pytest.fixture
def own_harness(redis_server, fake_model) -> Iterator[TurnHarness]:
    """A coordinator in this process with keys and queues of its own (`tests.harness`):
    nothing runs until it drains, and every cancel key under its prefix is this test's."""
    harness = TurnHarness(redis_server.url, fake_model.url)
    yield harness
    harness.close()


def test_a_cancel_before_the_run_starts_ends_it_cancelled_as_it_starts(
    own_harness: TurnHarness, script
) -> None:
    env = own_harness.env
    prompt = script([DONE])
    cli_prompt = script([DONE])
    client = own_harness.client
    assert client.cancel("never-submitted", ui=True) is False  # unknown: unchanged
    assert not client.redis.exists(client.keys.cancel("never-submitted"))
    run = client.submit(prompt=prompt)
    assert run.cancel(ui=True, reason="changed my mind")
    assert client.redis.ttl(client.keys.cancel(run.run_id)) > 0
    cli = subprocess.Popen(
        [sys.executable, "-m", "cmdop_worker.surfaces.cli", "run", cli_prompt, "--json"],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert cli.stderr is not None
    read_until(cli.stderr, "no coordinator is running")
    time.sleep(0.5)  # the warning is printed just before Ctrl-C is taken over
    cli.send_signal(signal.SIGINT)
    read_until(cli.stderr, "cancelling the run")
    wait_for_cancel_keys(client, 2)  # the client's run and the CLI's
    result = run.wait(timeout=60, raise_on_failure=False)  # the coordinator takes both starts
    out, _ = cli.communicate(timeout=60)
    assert result.status == "cancelled" and result.cancel is not None
    assert result.cancel.channel == "ui" and result.cancel.reason == "changed my mind"
    assert cli.returncode == 130, out
    assert '"channel":"ui"' in out.replace(" ", "")
    assert script.requests_for(prompt) == [] and script.requests_for(cli_prompt) == []


# -- fenced writes and the lease ------------------------------------------------------------


def test_a_holder_that_lost_its_lease_cannot_save_dispatch_or_end_the_run(rt) -> None:
    state = stored_run(rt)
    before = rt.store.load_raw(state.run_id)
    lease = TurnLease(rt, state.run_id, 1)
    assert lease.acquire()
    lock = rt.keys.turn(state.run_id, 1, "lock")
    rt.redis.set(lock, "a-successor", px=30_000)  # the lease lapsed; a successor took it
    moved = state.model_copy(update={"turn": 1, "text": "stale"})
    with fenced(lease.fence):
        with pytest.raises(LeaseLost):
            rt.store.save(moved)
        with pytest.raises(LeaseLost):
            finish_done(rt, moved, Finish("stale", "end_turn"))
    step = RunTools(tool_uses=(command("alpha", "echo never", "toolu_fenced_1"),))
    with lease:  # the turn's own scope: the refused write stops the turn's work, quietly
        start_calls(rt, moved, 1, step, read_fleet(rt, moved))
        pytest.fail("dispatch went on after its state write was refused")
    assert rt.store.load_raw(state.run_id) == before
    assert rt.store.load_result(state.run_id) is None
    assert rt.redis.get(rt.keys.turn(state.run_id, 1, "expected")) is None
    assert not rt.redis.exists(rt.keys.events(state.run_id))  # no TOOL_START, no DONE
    assert rt.redis.get(lock) == "a-successor"


def test_a_renewal_failing_on_redis_errors_loses_the_lease_once_its_time_is_up(
    fleet, fleet_env
) -> None:
    rt = Runtime(Settings(redis_url=fleet_env["CMDOP_REDIS_URL"], lease_s=0.3))
    try:
        state = stored_run(rt)
        lease = TurnLease(rt, state.run_id, 1)
        assert lease.acquire()
        from cmdop_worker.coordinator import lease as lease_module

        lease_module._renewer.remove(lease)  # renewed by hand here, not by the thread
        # Redis unreachable from this executor (and no hidden retries to sit through).
        lease._lock._redis = redis.Redis(
            port=1, socket_connect_timeout=0.05, retry=Retry(NoBackoff(), 0)
        )
        assert lease.renew() is True  # within the lease's time: try again later
        time.sleep(0.4)
        assert lease.renew() is False
        assert not lease.held()
        with fenced(lease.fence), pytest.raises(LeaseLost):
            rt.store.save(state.model_copy(update={"text": "after the lease ran out"}))
        assert rt.store.load(state.run_id) == state
    finally:
        rt.close()


# -- sequential turns -----------------------------------------------------------------------


def test_a_sequential_turn_runs_coordinator_tools_in_the_models_order(client, script) -> None:
    calls = [
        command("alpha", "sleep 0.5; echo first", "toolu_seq_a"),
        {"type": "tool_use", "id": "toolu_seq_l", "name": "list_machines", "input": {}},
        command("beta", "echo third", "toolu_seq_b"),
    ]
    prompt = script([calls, DONE])
    run = client.submit(prompt=prompt, parallel_tools=False)
    assert run.wait(timeout=60).status == "done"
    events = list(run.events())
    assert tool_order(events) == [
        "TOOL_START:toolu_seq_a",
        "TOOL_END:toolu_seq_a",
        "TOOL_START:toolu_seq_l",
        "TOOL_END:toolu_seq_l",
        "TOOL_START:toolu_seq_b",
        "TOOL_END:toolu_seq_b",
    ]


def test_recovery_sends_a_sequential_turns_calls_one_at_a_time(client, rt, script) -> None:
    prompt = script([DONE, [{"type": "text", "text": "{{result:0}} {{result:1}}"}]])
    state = stored_run(rt, prompt, parallel_tools=False)
    calls = [
        command("alpha", "sleep 0.5; echo one", "toolu_rec_1"),
        command("beta", "echo two", "toolu_rec_2"),
    ]
    pending = [
        PendingCall(
            tool_use_id=str(c["id"]),
            tool="execute_command",
            machine=c["input"]["machine"],
            deadline_ms=now_ms() + 30_000,
        )
        for c in calls
    ]
    # The reply is stored and its calls awaited, but nothing was sent: the coordinator
    # died inside start_calls.
    cut = state.model_copy(
        update={
            "turn": 1,
            "history": [*state.history, Message(role="assistant", content=calls)],
            "awaiting": pending,
        }
    )
    rt.redis.set(rt.keys.state(state.run_id), cut.model_dump_json())
    rt.store.schedule(advance_member(state.run_id, 1), now_ms())
    result = client.run(state.run_id).wait(timeout=60)
    events = list(client.events(state.run_id, idle_timeout_s=5))
    assert "one" in result.text and "two" in result.text
    assert tool_order(events) == [
        "TOOL_START:toolu_rec_1",
        "TOOL_END:toolu_rec_1",
        "TOOL_START:toolu_rec_2",
        "TOOL_END:toolu_rec_2",
    ]


# -- every TOOL_END has its TOOL_START; the same words for the same situation ----------------


def test_a_call_a_cancel_kept_from_starting_has_its_tool_start(client, script) -> None:
    sleep = sleeper(30)
    prompt = script(
        [[command("alpha", f"exec {sleep}", "toolu_ca_1"), command("beta", "echo x", "toolu_ca_2")]]
    )
    run = client.submit(prompt=prompt, parallel_tools=False, timeout_s=120)
    wait_for_sleeper(sleep)
    assert run.cancel(ui=True, reason="stop")
    result = run.wait(timeout=30, raise_on_failure=False)
    events = list(run.events())
    assert result.status == "cancelled"
    assert_each_end_has_one_start(events)
    ends = {e.data["tool_call_id"]: e.data for e in events if e.type == "TOOL_END"}
    assert ends["toolu_ca_2"]["status"] == "cancelled"
    assert "before it started" in ends["toolu_ca_2"]["output"]


@pytest.mark.parametrize(
    ("situation", "started", "machine", "status"),
    [
        ("cancel", False, "alpha", "cancelled"),
        ("cancel", True, "alpha", "cancelled"),
        ("cancel", False, None, "cancelled"),
        ("deadline", False, "alpha", "timeout"),
        ("deadline", True, "alpha", "lost"),
        ("deadline", False, None, "timeout"),
        ("deadline", True, None, "timeout"),
        ("machine_gone", False, "alpha", "offline"),
        ("machine_gone", True, "alpha", "lost"),
    ],
)
def test_the_same_situation_gets_the_same_status_word(situation, started, machine, status) -> None:
    call = PendingCall(tool_use_id="t1", tool="execute_command", machine=machine, deadline_ms=0)
    outcome = unanswered_outcome(call, situation, started=started, reason="r")
    assert outcome.status == status
    if status == "lost":
        assert outcome.output == "started on alpha; outcome unknown; machine lost"
