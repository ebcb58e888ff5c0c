"""The agent loop end to end: real workers, real Redis, the real SDK, the fake model.

What the coordinator alone decides (a start refused, a duplicate run id) is taken in
this process, with no worker (`turn_harness`, `tests.harness`)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from cmdop_worker.celery_app import create_app
from cmdop_worker.models import TERMINAL_EVENTS, Event
from cmdop_worker.state.keys import COORDINATOR_QUEUE
from tests.harness import TurnHarness

pytestmark = pytest.mark.integration

WHO = "echo $CMDOP_TEST_MACHINE_MARK"


def both_machines(turn: int) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": f"turn {turn}: asking both"},
        {
            "type": "tool_use",
            "name": "execute_command",
            "input": {"machine": "alpha", "command": WHO},
        },
        {
            "type": "tool_use",
            "name": "execute_command",
            "input": {"machine": "beta", "command": WHO},
        },
    ]


def assert_event_log_sound(events: list[Event]) -> None:
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    terminal = [e for e in events if e.type in TERMINAL_EVENTS]
    assert len(terminal) == 1 and terminal[0] is events[-1]


def test_three_turn_fan_out_runs_each_call_on_its_machine(client, fleet, script) -> None:
    prompt = script(
        [
            both_machines(1),
            both_machines(2),
            both_machines(3),
            [{"type": "text", "text": "all good: {{results}}"}],
        ]
    )
    run = client.submit(prompt=prompt, timeout_s=60)
    events = list(run.events(idle_timeout_s=30))
    result = run.wait(timeout=10)

    assert result.status == "done" and result.stop_reason == "end_turn"
    assert result.turns == 4
    assert result.text.startswith("all good: ")
    ends = [e for e in events if e.type == "TOOL_END"]
    assert len(ends) == 6
    for end in ends:
        machine = end.data["machine"]
        assert not end.data["is_error"], end.data
        assert f"mark-{machine}" in end.data["output"]
    assert_event_log_sound(events)

    # Each request after the first carried every result of the previous reply, by id.
    requests = script.requests_for(prompt)
    assert len(requests) == 4
    for before, after in itertools.pairwise(requests):
        asked = [b["id"] for b in before["response"]["content"] if b["type"] == "tool_use"]
        last_user = after["body"]["messages"][-1]
        answered = [
            b["tool_use_id"] for b in last_user["content"] if b.get("type") == "tool_result"
        ]
        assert answered == asked


def test_events_replay_in_order_for_a_late_reader(client, script) -> None:
    prompt = script([both_machines(1), [{"type": "text", "text": "done"}]])
    run = client.submit(prompt=prompt)
    run.wait(timeout=30)
    late = list(run.events(idle_timeout_s=5))
    assert late[-1].type == "DONE"
    assert_event_log_sound(late)
    assert [e.type for e in late].count("TOOL_START") == 2


def test_turn_limit_stops_the_run_with_max_turns(client, script) -> None:
    prompt = script([both_machines(1)])  # repeats forever
    run = client.submit(prompt=prompt, max_turns=2)
    result = run.wait(timeout=30)
    assert result.stop_reason == "max_turns"
    assert result.turns == 2
    # The last turn's results are in the stored history, so it stays valid.
    last = result.messages[-1]
    assert last.role == "user"
    assert all(b["type"] == "tool_result" for b in last.content)


@pytest.mark.parametrize(
    ("request_body", "field"),
    [
        ({"agent": "operator"}, "prompt"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": "hi", "machine": "Bad Name!"}, "machine"),
        ({"prompt": "hi", "max_turns": 0}, "max_turns"),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"prompt": "hi", "agent": "no-such-agent"}, "agent"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(turn_harness, request_body, field) -> None:
    client = turn_harness.client
    run_id = f"bad-{abs(hash(json.dumps(request_body, sort_keys=True)))}"
    app = create_app(client.settings)
    async_result = app.send_task(
        "cmdop.run", kwargs={"request": {**request_body, "run_id": run_id}}, queue=COORDINATOR_QUEUE
    )
    turn_harness.drain()
    with pytest.raises(Exception) as caught:
        async_result.get(timeout=20)
    assert field in str(caught.value)
    assert client.redis.exists(client.keys.state(run_id)) == 0
    assert client.redis.exists(client.keys.events(run_id)) == 0


def test_client_refuses_a_bad_request_before_sending(turn_harness: TurnHarness) -> None:
    client = turn_harness.client
    from cmdop_worker.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="timeout_s"):
        client.submit(prompt="hi", timeout_s=-1)


def test_duplicate_run_id_is_refused_and_the_first_run_is_untouched(turn_harness, script) -> None:
    client = turn_harness.client
    prompt = script([[{"type": "text", "text": "first"}]])
    run = client.submit(prompt=prompt, run_id="dup-run-1")
    assert run.wait(timeout=20).text == "first"
    app = create_app(client.settings)
    second = app.send_task(
        "cmdop.run",
        kwargs={"request": {"prompt": "again", "run_id": "dup-run-1"}},
        queue=COORDINATOR_QUEUE,
    )
    turn_harness.drain()
    with pytest.raises(Exception, match="already exists"):
        second.get(timeout=20)
    assert run.result().text == "first"
