"""Answering a tool call that waits for a person, through the CLI and the client.

The session fleet's machines run in mode bypass; this module adds two machines in mode
default (every call asks): `asker` waits 30 s for an answer, `asker-quick` 1 s. An
answer is taken only while the call's approval request is waiting; anything else exits
2 (the CLI) or raises (the client) saying why, having answered nothing.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cmdop_worker.errors import ApprovalNotPending, RunNotFound
from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client, Run
from tests.e2e.test_cli import CLI, cli, text, tool

pytestmark = pytest.mark.e2e

ASKERS = {"asker": "30", "asker-quick": "1"}


@pytest.fixture(scope="module", autouse=True)
def askers(fleet) -> Iterator[None]:
    for name, wait_s in ASKERS.items():
        fleet.start_machine(
            name, {"CMDOP_PERMISSION_MODE": "default", "CMDOP_APPROVAL_TIMEOUT_S": wait_s}
        )
    try:
        fleet.wait_ready(["alpha", "beta", *ASKERS], timeout_s=60)
        yield
    finally:
        for name in ASKERS:  # a clean stop takes the machine's presence with it
            fleet.workers.pop(name).stop()


@pytest.fixture
def cli_env(fleet_env) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, **fleet_env, "NO_COLOR": "", "COLUMNS": "100"}


def asked(run: Run[Any]) -> tuple[Event, Iterator[Event]]:
    """The run's APPROVAL_REQUEST, and its events from there on."""
    events = run.events(idle_timeout_s=30)
    for event in events:
        if event.type == "APPROVAL_REQUEST":
            return event, events
        assert not event.is_terminal, event
    raise AssertionError("no approval request")


def end_of(events: Iterator[Event], tool_call_id: str) -> Event:
    for event in events:
        if event.type == "TOOL_END" and event.data["tool_call_id"] == tool_call_id:
            return event
    raise AssertionError(f"no TOOL_END for {tool_call_id}")


def test_an_approval_through_the_cli_runs_the_call_and_a_second_one_exits_2(
    client: Client, cli_env, script
) -> None:
    run = client.submit(prompt=script([[tool("asker", "echo let-me")], text("ok")]))
    request, events = asked(run)
    call_id = request.data["tool_call_id"]
    done = cli(cli_env, "approve", run.run_id, call_id)
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout
        == f"approved tool call {call_id} (execute_command on asker) of run {run.run_id}\n"
    )
    end = end_of(events, call_id)
    assert end.data["status"] == "ok" and "let-me" in end.data["output"]

    again = cli(cli_env, "approve", run.run_id, call_id, "--deny")
    assert again.returncode == 2
    assert again.stderr.startswith(
        f"cmdop-worker: tool call {call_id} of run {run.run_id} is no longer waiting: "
        "it has already been answered (approved by "
    )
    assert again.stderr.count("\n") == 1


def test_a_denial_after_a_wait_reports_the_time_the_call_waited(
    client: Client, cli_env, script
) -> None:
    run = client.submit(prompt=script([[tool("asker", "echo never")], text("refused")]))
    request, events = asked(run)
    call_id = request.data["tool_call_id"]
    time.sleep(1.0)
    done = cli(cli_env, "approve", run.run_id, call_id, "--deny")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"denied tool call {call_id} (execute_command on asker)")
    end = end_of(events, call_id)
    assert end.data["status"] == "denied"
    assert end.data["output"].startswith("permission denied by a person")
    # It waited for a person, and never ran: the wait is told apart from a run time.
    assert end.data["waited_ms"] >= 1000 and end.data["duration_ms"] == 0, end.data


def test_an_unknown_run_or_call_exits_2_saying_which(client: Client, cli_env, script) -> None:
    nobody = cli(cli_env, "approve", "0000", "toolu_nope")
    assert (nobody.returncode, nobody.stderr) == (
        2,
        "cmdop-worker: no run 0000 (unknown, or expired)\n",
    )
    run = client.submit(prompt=script([text("nothing to ask")]))
    run.wait(timeout=30)
    no_call = cli(cli_env, "approve", run.run_id, "toolu_nope")
    assert (no_call.returncode, no_call.stderr) == (
        2,
        f"cmdop-worker: run {run.run_id} has no approval request for tool call toolu_nope\n",
    )
    assert client.redis.keys(client.keys.approval(run.run_id, "toolu_nope", "*")) == []


def test_a_call_whose_wait_ran_out_takes_no_answer(client: Client, cli_env, script) -> None:
    run = client.submit(prompt=script([[tool("asker-quick", "echo late")], text("too late")]))
    request, events = asked(run)
    call_id = request.data["tool_call_id"]
    assert end_of(events, call_id).data["status"] == "denied"
    late = cli(cli_env, "approve", run.run_id, call_id)
    assert late.returncode == 2
    assert "is no longer waiting: its approval request expired after 1 s" in late.stderr


def test_the_client_raises_typed_errors_and_writes_nothing(client: Client, script) -> None:
    with pytest.raises(RunNotFound, match="no run 0000"):
        client.approve("0000", "toolu_nope")
    run = client.submit(prompt=script([text("nothing to ask")]))
    run.wait(timeout=30)
    with pytest.raises(ApprovalNotPending) as caught:
        run.approve("toolu_nope", approve=False)
    assert caught.value.why == "no_request"
    assert client.redis.keys(client.keys.approval(run.run_id, "toolu_nope", "*")) == []


def test_the_live_view_says_how_to_answer_deny_and_set_a_policy(
    client: Client, cli_env, script
) -> None:
    prompt = script([[tool("asker", "echo shown")], text("answered")])
    proc = subprocess.Popen(
        [CLI, "run", prompt], env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        lines = [proc.stdout.readline()]
        while "needs approval" not in lines[-1]:
            assert lines[-1], lines
            lines.append(proc.stdout.readline())
        hint = proc.stdout.readline()
        run_id = lines[0].split()[1]
        (request,) = [e for e in client.events_so_far(run_id) if e.type == "APPROVAL_REQUEST"]
        call_id = request.data["tool_call_id"]
        assert f"cmdop-worker approve {run_id} {call_id}" in hint
        assert "--deny" in hint and "within 30 s" in hint
        assert "CMDOP_POLICY_FILE" in hint and "config/policy.example.toml" in hint
        assert cli(cli_env, "approve", run_id, call_id, "--deny").returncode == 0
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    assert "✗ execute_command on asker" in out


def test_an_approval_request_shows_the_file_the_call_will_touch(
    client: Client, script, tmp_path
) -> None:
    target = tmp_path / "real-target.txt"
    target.write_text("x")
    link = tmp_path / "innocent-name"
    link.symlink_to(target)
    read = {"type": "tool_use", "name": "read_file", "input": {"machine": "asker-quick"}}
    read["input"]["path"] = str(link)
    run = client.submit(prompt=script([[read], text("done")]))
    request, _ = asked(run)
    assert request.data["input"]["path"] == str(link)
    assert request.data["resolved_input"]["path"] == os.path.realpath(target)
