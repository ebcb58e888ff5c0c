"""Parked approvals through real workers: a call that asks a person holds nothing.

Two machines join the session fleet under a policy of their own (mode default: every
call asks, but `echo free…` is allowed and `tee` denied): `parker` waits 300 s for an
answer, `parker-quick` 1 s. A parked call must survive a wait longer than its own
timeout, run an input a person edited (never past a deny rule or the floor), tell the
model a denial's reason, leave its machine free for other calls, and take exactly one
answer. Every parked-then-resolved call keeps its TOOL_START before its TOOL_END.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.models import Event
from cmdop_worker.state.approvals import Approvals
from cmdop_worker.state.connect import now_ms
from cmdop_worker.state.events import EventSink
from cmdop_worker.surfaces.client import Client, Run

PARKERS = {"parker": "300", "parker-quick": "1"}
POLICY = """
mode = "default"
[rules]
allow = ["execute_command(echo free*)"]
deny = ["execute_command(tee *)"]
[sandbox]
writable = ["/tmp"]
approved_writable = ["/tmp"]
"""
CLI = str(Path(sys.executable).with_name("cmdop-worker"))


@pytest.fixture(scope="module")
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parked") / "audit.log"


@pytest.fixture(scope="module", autouse=True)
def parkers(fleet, audit_log: Path) -> Iterator[None]:
    policy = audit_log.parent / "policy.toml"
    policy.write_text(POLICY)
    for name, wait_s in PARKERS.items():
        extra = {
            "CMDOP_PERMISSION_MODE": "default",
            "CMDOP_POLICY_FILE": str(policy),
            "CMDOP_APPROVAL_TIMEOUT_S": wait_s,
            "CMDOP_AUDIT_LOG": str(audit_log),
        }
        fleet.start_machine(name, extra)
    try:
        fleet.wait_ready(["alpha", *PARKERS], timeout_s=60)
        yield
    finally:
        for name in PARKERS:
            fleet.workers.pop(name).stop()


def command(machine: str, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": machine, "command": text, **extra},
    }


def reply(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]


def cli(fleet_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **fleet_env, "NO_COLOR": ""}
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=60)


def asked(run: Run[Any], count: int = 1) -> list[Event]:
    """The run's first `count` APPROVAL_REQUESTs, once they are all written."""
    found: list[Event] = []
    for event in run.events(idle_timeout_s=60):
        assert not event.is_terminal, event
        if event.type == "APPROVAL_REQUEST":
            found.append(event)
            if len(found) == count:
                return found
    raise AssertionError(f"{len(found)} approval requests, not {count}")


def ended(run: Run[Any], timeout_s: float = 60) -> tuple[str, list[Event]]:
    """The run's final status and all its events, checking every TOOL_END follows its
    TOOL_START (the parked calls' starts were written before they parked)."""
    result = run.wait(timeout=timeout_s, raise_on_failure=False)
    events = run.client.events_so_far(run.run_id)
    started: set[str] = set()
    for event in events:
        if event.type == "TOOL_START":
            started.add(event.data["tool_call_id"])
        elif event.type == "TOOL_END":
            assert event.data["tool_call_id"] in started, event
    return result.status, events


def of(events: list[Event], type_: str, tool_call_id: str | None = None) -> list[Event]:
    return [
        e for e in events if e.type == type_ and tool_call_id in (None, e.data.get("tool_call_id"))
    ]


def tool_results(script, prompt: str) -> list[dict[str, Any]]:
    """The tool_result blocks the model was sent, in the run's last request."""
    last = script.requests_for(prompt)[-1]["body"]["messages"][-1]
    return [b for b in last["content"] if b.get("type") == "tool_result"]


def audited(audit_log: Path, run_id: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in audit_log.read_text().splitlines()]
    return [line for line in lines if line["run_id"] == run_id]


def state_of(client: Client, run_id: str, tool_call_id: str) -> str | None:
    events = EventSink(client.redis, client.keys, maxlen=100, ttl_s=60, clock_ms=now_ms)
    record = Approvals(client.redis, client.keys, events, ttl_s=60).load(run_id, tool_call_id)
    return None if record is None else record.state


def test_an_approval_after_the_calls_own_timeout_runs_it_to_completion(
    client: Client, script, audit_log: Path
) -> None:
    prompt = script([[command("parker", "echo patient", timeout_ms=1000)], reply("ran")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    # Past the call's own timeout and the turn's deadline set from it (1 s + 1.5 s of
    # grace): neither may time out the parked call.
    time.sleep(3.0)
    run.approve(call_id, by="ann")
    status, events = ended(run)
    assert status == "done"
    (end,) = of(events, "TOOL_END", call_id)
    assert end.data["status"] == "ok" and "patient" in end.data["output"], end.data
    # Its own run time, and beside it the 3 s it waited for the person.
    assert end.data["waited_ms"] >= 3000 > end.data["duration_ms"], end.data
    (resolved,) = of(events, "APPROVAL_RESOLVED", call_id)
    assert resolved.data == {"tool_call_id": call_id, "verdict": "approved", "by": "ann"}
    assert resolved.seq < end.seq
    (line,) = audited(audit_log, run.run_id)
    assert (line["verdict"], line["final"]) == ("ask", "approved")


def test_an_edited_approval_runs_the_edited_input_and_tells_the_model(
    client: Client, script, fleet_env, tmp_path: Path
) -> None:
    original, edited = tmp_path / "original", tmp_path / "edited"
    prompt = script([[command("parker", f"echo original > {original}")], reply("ran")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    new_input = {"command": f"echo edited > {edited}"}
    done = cli(fleet_env, "approve", run.run_id, call_id, "--input", json.dumps(new_input))
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("with the edited input\n")
    status, events = ended(run)
    assert status == "done"
    assert edited.read_text() == "edited\n" and not original.exists()
    (resolved,) = of(events, "APPROVAL_RESOLVED", call_id)
    assert resolved.data["input"] == {**new_input, "machine": "parker"}
    (result,) = tool_results(script, prompt)
    assert result["content"].startswith("[ran with input edited by ")
    assert json.dumps(new_input) in result["content"] and "is_error" not in result


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        ("echo sneaky | tee {marker}", "deny rule 'execute_command(tee *)'"),
        ("echo sneaky > {dir}/.env", ".env"),
    ],
    ids=["deny-rule", "floor"],
)
def test_an_edited_input_is_gated_again_and_denied_past_a_deny_or_the_floor(
    client: Client, script, tmp_path: Path, audit_log: Path, edit: str, says: str
) -> None:
    marker = tmp_path / "marker"
    prompt = script([[command("parker", "echo harmless")], reply("refused")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    new_command = edit.format(marker=marker, dir=tmp_path)
    run.approve(call_id, input={"command": new_command}, by="ann")
    status, events = ended(run)
    assert status == "done"
    assert not marker.exists() and not (tmp_path / ".env").exists()
    (end,) = of(events, "TOOL_END", call_id)
    assert end.data["status"] == "denied", end.data
    assert end.data["output"].startswith("permission denied: ") and says in end.data["output"]
    assert "edited by ann" in end.data["output"]
    (line,) = audited(audit_log, run.run_id)
    assert (line["verdict"], line["final"]) == ("deny", "deny")


def test_a_denial_with_a_reason_reaches_the_model(client: Client, script, fleet_env) -> None:
    prompt = script([[command("parker", "echo in production")], reply("understood")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    why = "not on a Friday; try the staging box"
    done = cli(fleet_env, "approve", run.run_id, call_id, "--deny", "--reason", why, "--by", "bo")
    assert done.returncode == 0, done.stderr
    status, events = ended(run)
    assert status == "done"
    (result,) = tool_results(script, prompt)
    assert result["is_error"] is True
    assert result["content"] == f"permission denied by a person (bo): {why}"
    (resolved,) = of(events, "APPROVAL_RESOLVED", call_id)
    assert resolved.data == {
        "tool_call_id": call_id,
        "verdict": "denied",
        "by": "bo",
        "reason": why,
    }


def test_a_machine_with_50_parked_calls_still_runs_its_other_calls(client: Client, script) -> None:
    waiting = client.submit(
        prompt=script([[command("parker", f"echo parked {i}") for i in range(50)], reply("x")])
    )
    call_ids = [e.data["tool_call_id"] for e in asked(waiting, 50)]
    free = client.submit(prompt=script([[command("parker", "echo free to go")], reply("ok")]))
    status, free_events = ended(free)
    assert status == "done"
    (end,) = of(free_events, "TOOL_END")
    assert end.data["status"] == "ok" and "free to go" in end.data["output"]
    # It finished while all fifty still wait: none has an end or an answer.
    so_far = client.events_so_far(waiting.run_id)
    assert of(so_far, "TOOL_END") == [] and of(so_far, "APPROVAL_RESOLVED") == []
    assert {state_of(client, waiting.run_id, c) for c in call_ids} == {"waiting"}

    waiting.cancel(ui=True)
    status, events = ended(waiting)
    assert status == "cancelled"
    assert {e.data["status"] for e in of(events, "TOOL_END")} == {"cancelled"}
    assert len(of(events, "APPROVAL_RESOLVED")) == 50


def test_approving_an_unknown_answered_or_expired_call_exits_2_saying_which(
    client: Client, script, fleet_env
) -> None:
    run = client.submit(prompt=script([[command("parker", "echo once")], reply("ok")]))
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    unknown = cli(fleet_env, "approve", run.run_id, "toolu_nope")
    assert (unknown.returncode, unknown.stderr) == (
        2,
        f"cmdop-worker: run {run.run_id} has no approval request for tool call toolu_nope\n",
    )
    assert cli(fleet_env, "approve", run.run_id, call_id, "--by", "ann").returncode == 0
    again = cli(fleet_env, "approve", run.run_id, call_id, "--deny")
    assert again.returncode == 2
    assert again.stderr == (
        f"cmdop-worker: tool call {call_id} of run {run.run_id} is no longer waiting: "
        "it has already been answered (approved by ann)\n"
    )
    assert ended(run)[0] == "done"

    late_run = client.submit(prompt=script([[command("parker-quick", "echo late")], reply("ok")]))
    (late_request,) = asked(late_run)
    late_id = late_request.data["tool_call_id"]
    status, events = ended(late_run)
    assert status == "done"
    (end,) = of(events, "TOOL_END", late_id)
    assert end.data["output"] == "permission denied: nobody approved within 1 s"
    (resolved,) = of(events, "APPROVAL_RESOLVED", late_id)
    assert (resolved.data["verdict"], resolved.data["by"]) == ("expired", "timeout")
    assert resolved.seq < end.seq
    late = cli(fleet_env, "approve", late_run.run_id, late_id)
    assert late.returncode == 2
    assert late.stderr.endswith("is no longer waiting: its approval request expired after 1 s\n")


def test_a_ui_cancel_answers_a_parked_call_at_once_and_closes_it(
    client: Client, script, fleet_env, audit_log: Path
) -> None:
    run = client.submit(prompt=script([[command("parker", "echo never")], reply("x")]))
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    run.cancel(ui=True, reason="changed my mind")
    status, events = ended(run, timeout_s=30)
    assert status == "cancelled"
    (end,) = of(events, "TOOL_END", call_id)
    assert (end.data["status"], end.data["output"]) == (
        "cancelled",
        "cancelled while waiting for approval",
    )
    (resolved,) = of(events, "APPROVAL_RESOLVED", call_id)
    assert (resolved.data["verdict"], resolved.data["by"]) == ("cancelled", "ui cancel")
    late = cli(fleet_env, "approve", run.run_id, call_id)
    assert late.returncode == 2
    assert late.stderr.endswith("no longer waiting: it was cancelled while waiting for approval\n")
    # The machine is told too, so its audit log has the final verdict.
    give_up = time.monotonic() + 30
    while not audited(audit_log, run.run_id) and time.monotonic() < give_up:
        time.sleep(0.05)
    (line,) = audited(audit_log, run.run_id)
    assert line["final"] == "cancelled"


def test_an_operation_cancel_does_not_leave_the_run_waiting_for_a_person(
    client: Client, script
) -> None:
    run = client.submit(prompt=script([[command("parker", "echo never")], reply("x")]))
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    run.cancel(reason="wrap up")
    status, events = ended(run, timeout_s=30)  # the call would wait 300 s for a person
    assert status == "cancelled"
    (end,) = of(events, "TOOL_END", call_id)
    assert end.data["output"] == "cancelled while waiting for approval"
    assert state_of(client, run.run_id, call_id) == "cancelled"


def test_a_sequential_turn_sends_its_next_call_once_the_parked_one_is_answered(
    client: Client, script
) -> None:
    calls = [command("parker", "echo first"), command("parker", "echo free second")]
    run = client.submit(prompt=script([calls, reply("both")]), parallel_tools=False)
    (request,) = asked(run)
    first = request.data["tool_call_id"]
    run.approve(first)
    status, events = ended(run)
    assert status == "done"
    starts = of(events, "TOOL_START")
    assert [e.data["input"]["command"] for e in starts] == ["echo first", "echo free second"]
    (first_end,) = of(events, "TOOL_END", first)
    assert first_end.data["status"] == "ok"
    assert first_end.seq < starts[1].seq


def test_a_parked_call_outlives_its_machine_going_away_and_runs_when_it_returns(
    client: Client, fleet, script, audit_log: Path
) -> None:
    """A parked call holds nothing on its machine: the liveness probe must not answer it
    "offline" while the machine is away (a worker restart during a person's wait)."""
    name = "parker-restart"
    extra = {
        "CMDOP_PERMISSION_MODE": "default",
        "CMDOP_POLICY_FILE": str(audit_log.parent / "policy.toml"),
        "CMDOP_APPROVAL_TIMEOUT_S": "300",
    }
    fleet.start_machine(name, extra)
    fleet.wait_ready([name], timeout_s=60)
    prompt = script([[command(name, "echo back again")], reply("ran: {{result:0}}")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    fleet.workers.pop(name).stop()
    presence = client.keys.machine(name)
    give_up = time.monotonic() + 30
    while client.redis.exists(presence):
        assert time.monotonic() < give_up, "the stopped machine kept its presence"
        time.sleep(0.05)
    answered = lambda: of(client.events_so_far(run.run_id), "TOOL_END", call_id)  # noqa: E731
    # The probe saw the machine gone, twice over (or answered the call: the bug).
    _probed(client, run.run_id, request.turn, times=3, unless=answered)
    assert not answered(), "the parked call was answered while it waited for a person"
    assert state_of(client, run.run_id, call_id) == "waiting"

    fleet.start_machine(name, extra)
    try:
        fleet.wait_ready([name], timeout_s=60)
        run.approve(call_id, by="ann")
        status, events = ended(run)
    finally:
        fleet.workers.pop(name).stop()
    assert status == "done"
    (end,) = of(events, "TOOL_END", call_id)
    assert end.data["status"] == "ok" and "back again" in end.data["output"]


def _probed(client: Client, run_id: str, turn: int, *, times: int, unless: Any) -> None:
    """Wait until the turn's liveness probe has run `times` more times (each run moves
    its watchdog entry on), or `unless()` is true."""
    member = f"probe:{run_id}:{turn}"
    seen = client.redis.zscore(client.keys.deadlines, member)
    runs, give_up = 0, time.monotonic() + 60
    while runs < times and not unless():
        assert time.monotonic() < give_up, "the liveness probe stopped coming"
        score = client.redis.zscore(client.keys.deadlines, member)
        if score is not None and score != seen:
            runs, seen = runs + 1, score
        time.sleep(0.05)
