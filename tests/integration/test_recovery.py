"""Each weak spot the chaos test can hit only by luck, hit on purpose.

The state a crash leaves behind is written directly into the session fleet's Redis,
and the fleet must carry the run to its end:

- the writer that completed a turn died before enqueueing the next one;
- `cmdop.run` died after storing the run, before enqueueing turn 1 (redelivered);
- the coordinator died while dispatching a turn's tool calls;
- the coordinator died while ending a run, before its terminal event;
- a watchdog entry was claimed by a coordinator that then died.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from cmdop_worker.celery_app import create_app
from cmdop_worker.coordinator.runs import initial_state
from cmdop_worker.core.history import is_valid_history
from cmdop_worker.core.intake import parse_request
from cmdop_worker.models import TERMINAL_EVENTS, Message, RunResult, ToolOutcome
from cmdop_worker.runtime import now_ms
from cmdop_worker.state.keys import COORDINATOR_QUEUE, Keys, advance_member
from cmdop_worker.state.store import PendingCall, Recorded, RunStore

pytestmark = pytest.mark.integration


def echo(machine: str, command: str, tool_use_id: str | None = None) -> dict[str, object]:
    block: dict[str, object] = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": machine, "command": command},
    }
    if tool_use_id:
        block["id"] = tool_use_id
    return block


def terminal_events(client, run_id: str) -> list[str]:
    events = list(client.events(run_id, idle_timeout_s=5))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    return [e.type for e in events if e.type in TERMINAL_EVENTS]


def test_a_turn_completed_by_a_writer_that_died_still_advances(client, rt, script) -> None:
    prompt = script(
        [[echo("alpha", "sleep 2; echo real")], [{"type": "text", "text": "{{result:0}}"}]]
    )
    run = client.submit(prompt=prompt, timeout_s=60)
    for event in run.events(idle_timeout_s=20):
        if event.type == "TOOL_START":
            break
    # Sent as its block closed, the call may start before the turn stores its reply.
    give_up = time.monotonic() + 20
    while not ((state := rt.store.load(run.run_id)) and state.awaiting):
        assert time.monotonic() < give_up, "the turn never stored its calls"
        time.sleep(0.02)
    assert len(state.awaiting) == 1
    call = state.awaiting[0]
    # Record the outcome as a writer would and "die" before enqueueing turn 2.
    outcome = ToolOutcome(
        tool_use_id=call.tool_use_id, tool=call.tool, output="recorded, then died"
    )
    assert rt.store.record_outcome(run.run_id, 1, outcome)[0] is Recorded.ADVANCE
    result = run.wait(timeout=30)
    assert result.text == "recorded, then died"  # the real outcome came second: not stored
    assert terminal_events(client, run.run_id) == ["DONE"]


def test_a_redelivered_start_enqueues_turn_1_the_first_delivery_never_did(
    client, rt, script
) -> None:
    prompt = script([[{"type": "text", "text": "started after all"}]])
    run_id = f"restart-{uuid.uuid4().hex[:10]}"
    request = {"prompt": prompt, "run_id": run_id}
    task_id = f"{run_id}.start"
    state = initial_state(rt, parse_request(request), run_id).model_copy(update={"origin": task_id})
    assert rt.store.create(state)  # ...and the first delivery died here
    app = create_app(client.settings)
    sent = app.send_task(
        "cmdop.run", kwargs={"request": request}, queue=COORDINATOR_QUEUE, task_id=task_id
    )
    assert sent.get(timeout=20) == run_id
    assert client.run(run_id).wait(timeout=20).text == "started after all"


def test_a_dispatch_cut_short_is_completed_and_nothing_runs_twice(
    client, rt, script, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    prompt = script(
        [[{"type": "text", "text": "unused"}], [{"type": "text", "text": "{{result:0}}"}]]
    )
    run_id = f"cut-{uuid.uuid4().hex[:10]}"
    state = initial_state(rt, parse_request({"prompt": prompt}), run_id)
    call = echo("alpha", f"echo ran >> {effects}; echo dispatched late", "toolu_cut_1")
    # The model's reply is stored and the call awaited, but nothing was sent: the
    # coordinator died inside start_calls, right after saving the state.
    state = state.model_copy(
        update={
            "turn": 1,
            "history": [*state.history, Message(role="assistant", content=[call])],
            "awaiting": [
                PendingCall(
                    tool_use_id="toolu_cut_1",
                    tool="execute_command",
                    machine="alpha",
                    deadline_ms=now_ms() + 30_000,
                )
            ],
        }
    )
    assert rt.store.create(state)
    rt.store.schedule(advance_member(run_id, 1), now_ms())
    result = client.run(run_id).wait(timeout=30)
    assert "dispatched late" in result.text
    assert is_valid_history(result.messages) == []
    assert effects.read_text().split() == ["ran"]
    assert terminal_events(client, run_id) == ["DONE"]


def test_a_run_ended_without_its_terminal_event_gets_one(client, rt) -> None:
    run_id = f"mute-{uuid.uuid4().hex[:10]}"
    state = initial_state(rt, parse_request({"prompt": "hi"}), run_id)
    done = state.model_copy(update={"status": "done", "turn": 1, "text": "the end"})
    assert rt.store.create(done)
    rt.store.store_result(
        RunResult(run_id=run_id, status="done", stop_reason="end_turn", text="the end", turns=1)
    )
    # The coordinator died between storing the result and emitting DONE.
    rt.store.schedule(advance_member(run_id, 1), now_ms())
    events = list(client.events(run_id, idle_timeout_s=10))
    assert [(e.type, e.data.get("text")) for e in events] == [("DONE", "the end")]


def test_a_watchdog_entry_claimed_by_a_dead_coordinator_comes_due_again(rt) -> None:
    store = RunStore(rt.redis, Keys(f"claims-{uuid.uuid4().hex[:8]}:"), ttl_s=60)
    store.schedule("turn:r:1", now_ms())
    first = now_ms()
    assert store.claim_due(first, lease_ms=300) == ["turn:r:1"]
    assert store.claim_due(now_ms(), lease_ms=300) == []  # claimed: nobody else gets it
    time.sleep(0.4)  # the claimant died without releasing it
    second = now_ms()
    assert store.claim_due(second, lease_ms=300) == ["turn:r:1"]
    store.release_claim("turn:r:1", first + 300)  # a stale claim removes nothing
    assert rt.redis.zscore(store.keys.deadlines, "turn:r:1") is not None
    store.release_claim("turn:r:1", second + 300)
    assert rt.redis.zscore(store.keys.deadlines, "turn:r:1") is None
