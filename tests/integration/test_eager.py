"""Eager dispatch through the session fleet: tool calls go out while the reply streams.

Each test makes the reply fail, or the run be cancelled, after a call's block closed
and before the reply ended. A call that had gone out early must then be kept: run
once, its result in history, the model not asked again for that turn. With eager
dispatch off, the same streams would be retried from scratch (asserted by
`test_without_eager_dispatch_a_failed_stream_is_asked_again`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.core.history import is_valid_history
from cmdop_worker.models import TERMINAL_EVENTS, Event, RunResult
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet

pytestmark = pytest.mark.integration

ATTEMPTS = 6  # the fleet's model attempts: a fault this often fails every one of them
LONG = " ".join(f"word{i}" for i in range(60))  # streamed after the call, 20 deltas
# Events before the fault: message_start, ping, and the text and tool blocks before
# the long text (start, deltas, stop), then a few of the long text's deltas.
FAULT_AFTER = 14


def marked_call(effects: Path, marker: str, machine: str = "alpha", sleep: float = 0) -> Any:
    command = f"echo {marker} >> {effects}; sleep {sleep}; echo {marker}"
    return {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"command": command, "machine": machine},
    }


def ran(effects: Path) -> list[str]:
    return effects.read_text().split() if effects.exists() else []


def turn_one(result: RunResult) -> list[dict[str, Any]]:
    first = next(m for m in result.messages if m.role == "assistant")
    assert isinstance(first.content, list)
    return first.content


def wait_for(condition: Callable[[], bool], timeout_s: float = 30) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.02)


def results_of(result: RunResult) -> list[dict[str, Any]]:
    return [
        b
        for m in result.messages
        if m.role == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    ]


def one_terminal(events: list[Event]) -> Event:
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    terminal = [e for e in events if e.type in TERMINAL_EVENTS]
    assert len(terminal) == 1 and terminal[0] is events[-1]
    return terminal[0]


@pytest.mark.parametrize(
    "fault",
    [
        {"kind": "truncate", "after_events": FAULT_AFTER},
        {"kind": "error_event", "after_events": FAULT_AFTER},
        {"kind": "stall", "seconds": 4, "after_events": FAULT_AFTER},  # past the idle timeout
    ],
    ids=["truncate", "error_event", "stall"],
)
def test_a_stream_failing_after_a_call_went_out_keeps_the_call(
    client, script, tmp_path: Path, fault: dict[str, Any]
) -> None:
    effects, marker = tmp_path / "effects", f"m{uuid.uuid4().hex[:8]}"
    reply = [
        {"type": "text", "text": "checking alpha"},
        marked_call(effects, marker),
        {"type": "text", "text": LONG},
    ]
    prompt = script(
        [
            {"content": reply, "fault": {**fault, "times": ATTEMPTS}},
            [{"type": "text", "text": "done: {{results}}"}],
        ],
        token_delay_ms=20,
    )
    run = client.submit(prompt=prompt, timeout_s=60)
    result = run.wait(timeout=60)
    events = list(run.events(idle_timeout_s=10))

    assert one_terminal(events).type == "DONE" and result.status == "done"
    assert marker in result.text  # the model was given the call's result
    assert ran(effects) == [marker]  # run once
    # The turn kept the blocks it completed: the text and the call; the cut text is gone.
    content = turn_one(result)
    assert [b["type"] for b in content] == ["text", "tool_use"]
    assert content[1]["input"]["command"].startswith(f"echo {marker}")
    assert is_valid_history(result.messages) == []
    # Asked once for turn 1 (no retry of a committed reply), once for turn 2.
    assert len(script.requests_for(prompt)) == 2
    assert [e for e in events if e.type == "RETRY"] == []


def test_refused_calls_in_a_streamed_reply_are_answered_as_before(client, script, tmp_path) -> None:
    effects, marker = tmp_path / "effects", f"m{uuid.uuid4().hex[:8]}"
    reply = [
        {"type": "tool_use", "name": "teleport", "input": {"to": "mars"}},
        marked_call(effects, marker, machine="never-joined"),
        marked_call(effects, marker, machine="beta"),
        {"type": "text", "text": LONG},
    ]
    prompt = script([reply, [{"type": "text", "text": "done"}]], token_delay_ms=20)
    result = client.submit(prompt=prompt, timeout_s=60).wait(timeout=60)

    by_call = {b["tool_use_id"]: b for b in results_of(result)}
    calls = [b for b in turn_one(result) if b["type"] == "tool_use"]
    outputs = [str(by_call[c["id"]]["content"]) for c in calls]
    assert "tool 'teleport' does not exist" in outputs[0]
    assert "unknown machine 'never-joined'" in outputs[1]  # never seen: not merely offline
    assert marker in outputs[2] and not by_call[calls[2]["id"]].get("is_error")
    assert ran(effects) == [marker]
    assert is_valid_history(result.messages) == []


def test_a_ui_cancel_mid_reply_stops_the_call_sent_early(client, script, tmp_path) -> None:
    effects, marker = tmp_path / "effects", f"m{uuid.uuid4().hex[:8]}"
    late = tmp_path / "late"
    call = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {
            "command": f"echo {marker} >> {effects}; sleep 30; touch {late}",
            "machine": "alpha",
        },
    }
    prompt = script([[call, {"type": "text", "text": LONG * 4}]], token_delay_ms=100)
    run = client.submit(prompt=prompt, timeout_s=60)
    next(e for e in run.events(idle_timeout_s=30) if e.type == "TOOL_START")
    wait_for(lambda: ran(effects) == [marker])  # the command is running
    run.cancel(ui=True)
    result = run.wait(timeout=30, raise_on_failure=False)

    assert result.status == "cancelled"
    assert ran(effects) == [marker] and not late.exists()
    # The call that went out is in history, answered.
    assert [b["type"] for b in turn_one(result)] == ["tool_use"]
    assert is_valid_history(result.messages) == []
    answer = result.messages[-1].content
    assert isinstance(answer, list) and answer[0]["tool_use_id"] == turn_one(result)[0]["id"]
    events = list(run.events(idle_timeout_s=10))
    one_terminal(events)
    started = [e.data["tool_call_id"] for e in events if e.type == "TOOL_START"]
    ended = [e.data["tool_call_id"] for e in events if e.type == "TOOL_END"]
    assert started == ended == [turn_one(result)[0]["id"]]  # its TOOL_END too


def test_an_operation_cancel_mid_reply_lets_the_sent_call_finish(client, script, tmp_path) -> None:
    effects = tmp_path / "effects"
    first, second = f"a{uuid.uuid4().hex[:8]}", f"b{uuid.uuid4().hex[:8]}"
    release = tmp_path / "release"
    wait = f"while [ ! -e {release} ]; do sleep 0.05; done"
    waiting = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {
            "command": f"echo {first} >> {effects}; {wait}; echo {first}",
            "machine": "alpha",
        },
    }
    reply = [
        waiting,
        {"type": "text", "text": LONG * 6},
        marked_call(effects, second, machine="beta"),
    ]
    prompt = script([reply, [{"type": "text", "text": "never asked"}]], token_delay_ms=20)
    run = client.submit(prompt=prompt, timeout_s=60)
    next(e for e in run.events(idle_timeout_s=30) if e.type == "TOOL_START")
    run.cancel(reason="user")  # an operation cancel: honoured at the next boundary
    release.touch()
    result = run.wait(timeout=30, raise_on_failure=False)

    assert result.status == "cancelled"
    assert ran(effects) == [first]  # the call sent early ran to its end; the other never
    calls = [b for b in turn_one(result) if b["type"] == "tool_use"]
    answers = {b["tool_use_id"]: b for b in results_of(result)}
    assert first in str(answers[calls[0]["id"]]["content"])
    assert "before it started" in str(answers[calls[1]["id"]]["content"])
    assert is_valid_history(result.messages) == []
    assert len(script.requests_for(prompt)) == 1


def test_without_eager_dispatch_a_failed_stream_is_asked_again(
    fleet_env, redis_server, script, tmp_path: Path
) -> None:
    """The control of the first test: with `CMDOP_EAGER_DISPATCH=false` the call waits
    for the whole reply, so a stream that fails is retried and the call runs once, late."""
    url = redis_server.url.rsplit("/", 1)[0] + "/6"  # own database: own queues
    env = {**fleet_env, "CMDOP_REDIS_URL": url, "CMDOP_EAGER_DISPATCH": "false"}
    local = LocalFleet(env, logdir=tmp_path)
    effects, marker = tmp_path / "effects", f"m{uuid.uuid4().hex[:8]}"
    reply = [
        {"type": "text", "text": "checking"},
        marked_call(effects, marker),
        {"type": "text", "text": LONG},
    ]
    fault = {"kind": "truncate", "after_events": FAULT_AFTER, "times": 1}
    prompt = script([{"content": reply, "fault": fault}, [{"type": "text", "text": "done"}]])
    try:
        local.start_coordinator()
        local.start_machine("alpha")
        local.wait_ready(["alpha"], timeout_s=60)
        with Client(Settings(redis_url=url)) as client:
            result = client.submit(prompt=prompt, timeout_s=60).wait(timeout=60)
    finally:
        local.stop()
    assert result.status == "done" and ran(effects) == [marker]
    assert [b["type"] for b in turn_one(result)] == [
        "text",
        "tool_use",
        "text",
    ]  # the retried reply
    assert len(script.requests_for(prompt)) == 3  # turn 1 twice, then turn 2
    assert json.dumps(turn_one(result)).count(marker) == 2  # command: echo twice
