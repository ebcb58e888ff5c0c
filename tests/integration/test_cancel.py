"""Cancel across the fleet, and events that a reader never misses nor sees twice.

A cancel of a run that is unknown or over needs no worker: its run is taken by a
coordinator in this process (`turn_harness`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cmdop_worker.core.history import is_valid_history
from tests.harness import TurnHarness
from tests.procs import gone_within, process_gone, sleeper, wait_for_sleeper

pytestmark = pytest.mark.integration

DONE = [{"type": "text", "text": "finished"}]


def long_tool(command: str, machine: str = "beta") -> dict:
    return {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": machine, "command": command},
    }


def test_ui_cancel_kills_a_tool_on_another_machine_and_ends_cancelled(
    client, script, tmp_path
) -> None:
    sleep = sleeper(30)
    prompt = script([[long_tool(f"exec {sleep}")], DONE])
    run = client.submit(prompt=prompt, timeout_s=120)
    pid = wait_for_sleeper(sleep)
    assert not process_gone(pid)
    assert run.cancel(ui=True, reason="user pressed stop")
    events = list(run.events(idle_timeout_s=10))
    result = run.result()
    assert events[-1].type == "CANCELLED"
    assert events[-1].data["channel"] == "ui" and events[-1].data["reason"] == "user pressed stop"
    assert gone_within(pid, 5), "the tool's process survived a ui cancel"
    assert result is not None and result.status == "cancelled"
    assert is_valid_history(result.messages) == []
    last = result.messages[-1].content
    assert last[0]["type"] == "tool_result" and last[0]["is_error"] is True
    assert "cancelled" in last[0]["content"]
    assert len(script.requests_for(prompt)) == 1  # no model call after the cancel


def test_operation_cancel_lets_the_running_tool_finish(client, script) -> None:
    command = "sleep 1; echo tool-finished"
    call = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": "alpha", "command": command},
    }
    prompt = script([[call], DONE])
    run = client.submit(prompt=prompt)
    for event in run.events():
        if event.type == "TOOL_START":
            assert run.cancel(ui=False, reason="operator said stop")
            break
    result = run.wait(timeout=30, raise_on_failure=False)
    events = list(run.events())
    end = next(e for e in events if e.type == "TOOL_END")
    assert not end.data["is_error"] and "tool-finished" in end.data["output"]
    assert events[-1].type == "CANCELLED" and events[-1].data["channel"] == "operation"
    assert result.status == "cancelled" and is_valid_history(result.messages) == []
    assert len(script.requests_for(prompt)) == 1


def test_ui_cancel_drops_the_model_stream(client, script) -> None:
    words = " ".join(f"word{i}" for i in range(300))
    prompt = script([[{"type": "text", "text": words}]], token_delay_ms=20)
    run = client.submit(prompt=prompt)
    seen = ""
    for event in run.events():
        if event.type == "TOKEN":
            seen += event.data["text"]
            if len(seen) > 30:
                run.cancel(ui=True)
                break
    events = list(run.events(idle_timeout_s=10))
    assert events[-1].type == "CANCELLED"
    partial = events[-1].data["partial_text"]
    streamed = "".join(e.data["text"] for e in events if e.type == "TOKEN")
    assert partial == streamed and 30 < len(partial) < len(words)
    assert run.result().messages[-1].role == "user"


def test_the_run_deadline_ends_a_run_and_its_tool(client, script, tmp_path) -> None:
    sleep = sleeper(60)
    prompt = script([[long_tool(f"exec {sleep}", machine="alpha")], DONE])
    run = client.submit(prompt=prompt, timeout_s=2)
    pid = wait_for_sleeper(sleep)
    result = run.wait(timeout=20, raise_on_failure=False)
    assert result.status == "cancelled" and result.stop_reason == "timeout"
    assert result.cancel is not None and result.cancel.reason == "timeout"
    assert gone_within(pid, 5)
    assert is_valid_history(result.messages) == []


def test_cancel_of_an_unknown_or_finished_run_is_a_clear_no_op(
    turn_harness: TurnHarness, script
) -> None:
    client, fleet_env = turn_harness.client, turn_harness.env  # a coordinator in this process
    assert client.cancel("no-such-run", ui=True) is False
    prompt = script([DONE])
    run = client.submit(prompt=prompt)
    run.wait(timeout=20)
    assert run.cancel(ui=True) is False
    assert client.redis.exists(client.keys.cancel(run.run_id)) == 0
    done = subprocess.run(
        [sys.executable, "-m", "cmdop_worker.surfaces.cli", "cancel", run.run_id, "--ui"],
        env={**os.environ, **fleet_env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0
    assert "has already ended (done); nothing to cancel" in done.stdout


def test_a_reader_that_drops_and_resumes_misses_nothing(client, script) -> None:
    calls = [
        {
            "type": "tool_use",
            "name": "execute_command",
            "input": {"machine": m, "command": "sleep 0.2"},
        }
        for m in ("alpha", "beta")
    ]
    prompt = script([calls, calls, DONE])
    run = client.submit(prompt=prompt)
    first_part = []
    for event in run.events():
        first_part.append(event)
        if len(first_part) == 3:
            break  # the reader goes away mid-run
    rest = list(run.events(after_seq=first_part[-1].seq))
    seqs = [e.seq for e in first_part + rest]
    assert seqs == list(range(1, len(seqs) + 1))
    assert rest[-1].type == "DONE"


def test_a_killed_cli_reader_restarted_sees_every_event_once(client, script, fleet_env) -> None:
    calls = [
        {
            "type": "tool_use",
            "name": "execute_command",
            "input": {"machine": m, "command": "sleep 0.3"},
        }
        for m in ("alpha", "beta")
    ]
    prompt = script([calls, calls, calls, DONE])
    run = client.submit(prompt=prompt)
    env = {**os.environ, **fleet_env}
    argv = [sys.executable, "-m", "cmdop_worker.surfaces.cli", "events", run.run_id, "--json"]
    reader = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    assert reader.stdout is not None
    before = [json.loads(reader.stdout.readline()) for _ in range(3)]
    reader.kill()
    reader.wait()
    reader.stdout.close()
    after = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    replay = [json.loads(line) for line in after.stdout.splitlines()]
    assert after.returncode == 0
    assert replay[:3] == before  # a restarted reader replays from the first event
    assert [e["seq"] for e in replay] == list(range(1, len(replay) + 1))
    assert replay[-1]["type"] == "DONE"


def test_many_consumers_see_the_same_run(client, script) -> None:
    import threading

    prompt = script(
        [
            [
                {
                    "type": "tool_use",
                    "name": "execute_command",
                    "input": {"machine": "alpha", "command": "sleep 0.3"},
                }
            ],
            DONE,
        ]
    )
    run = client.submit(prompt=prompt)
    logs: list[list[int]] = [[] for _ in range(4)]

    def consume(log: list[int]) -> None:
        log.extend(e.seq for e in run.events(idle_timeout_s=20))

    threads = [threading.Thread(target=consume, args=(log,)) for log in logs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(log == logs[0] for log in logs) and logs[0] == list(range(1, len(logs[0]) + 1))


def test_events_of_an_unknown_run_end_with_a_clear_error(fleet_env) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cmdop_worker.surfaces.cli", "events", "never-was-a-run"],
        env={**os.environ, **fleet_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no run never-was-a-run" in done.stderr
