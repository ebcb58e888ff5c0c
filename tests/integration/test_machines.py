"""Machines against the real fleet: presence, routing, built-in and user tools,
permissions, the machine-loss watchdog, and ask_machine(s).

Most tests use the session fleet (`alpha`, `beta`, mode bypass). Tests that kill a
worker or need a permission policy use `iso`, a module-scoped fleet of its own on its
own redis-server (so its broker queues and presence keys are apart from the session's),
sharing only the fake model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.celery_app import create_app
from cmdop_worker.config import Settings
from cmdop_worker.coordinator.local_tools import ASK_TIMEOUT_DEFAULT_MS
from cmdop_worker.machine.registry import ToolContext, default_registry
from cmdop_worker.models import CancelRequest, Event, RunResult, ToolCall, ToolOutcome
from cmdop_worker.runtime import now_ms
from cmdop_worker.state.keys import machine_queue
from cmdop_worker.state.sent import mark_sent
from cmdop_worker.state.store import Recorded
from cmdop_worker.surfaces.client import Client, Run
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from tests.procs import wait_for

from ..conftest import repo_root

pytestmark = pytest.mark.integration

BUILTINS = ["execute_command", "glob", "grep", "list_dir", "read_file", "write_file"]
MARK = "echo $CMDOP_TEST_MACHINE_MARK"


# --- helpers ---------------------------------------------------------------------------


def use(name: str, **tool_input: Any) -> dict[str, Any]:
    return {"type": "tool_use", "name": name, "input": tool_input}


def calls_then_report(*uses: dict[str, Any]) -> list[object]:
    """Turn 1 makes the calls; turn 2 reports every result."""
    return [[{"type": "text", "text": "working"}, *uses], [{"type": "text", "text": "{{results}}"}]]


@dataclass
class Finished:
    run: Run
    result: RunResult
    events: list[Event]

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.type == kind]

    @property
    def ends(self) -> list[Event]:
        return self.of("TOOL_END")

    def ends_in_call_order(self) -> list[Event]:
        """TOOL_END events (which arrive as calls finish) in the order the model made them."""
        by_id = {e.data["tool_call_id"]: e for e in self.ends}
        asked = [
            block["id"]
            for message in self.result.messages
            if message.role == "assistant" and isinstance(message.content, list)
            for block in message.content
            if block.get("type") == "tool_use"
        ]
        return [by_id[i] for i in asked if i in by_id]


OnEvent = Callable[[Run, Event], None]


def finish(client: Client, prompt: str, on_event: OnEvent | None = None, **fields: Any) -> Finished:
    run = client.submit(prompt=prompt, **fields)
    events = []
    for event in run.events(idle_timeout_s=30):
        events.append(event)
        if on_event is not None:
            on_event(run, event)
    result = run.wait(timeout=10, raise_on_failure=False)
    return Finished(run, result, events)


def tool_results(result: RunResult) -> dict[str, dict[str, Any]]:
    """Every tool_result block of the stored history, by tool_use_id."""
    return {
        block["tool_use_id"]: block
        for message in result.messages
        if message.role == "user" and isinstance(message.content, list)
        for block in message.content
        if block.get("type") == "tool_result"
    }


def tool_spec(request: dict[str, Any], name: str) -> dict[str, Any]:
    tools = request["body"]["tools"]
    return next(t for t in tools if t["name"] == name)


def cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cmdop_worker.surfaces.cli", *argv],
        env={**os.environ, **env, "COLUMNS": "250"},
        cwd=repo_root(),
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- the isolated fleet ------------------------------------------------------------------

POLICY = """\
mode = "default"

[rules]
allow = ["execute_command(echo allowed*)", "read_file", "list_dir"]
ask = ["execute_command(echo ask-me*)"]
deny = ["execute_command(echo forbidden*)"]
"""
ASK_WAIT_S = 20.0  # p-ask: long enough for a person (a CLI subprocess) to answer
NO_ANSWER_WAIT_S = 1.5  # p-default: nobody answers


@dataclass
class Iso:
    fleet: LocalFleet
    client: Client
    env: dict[str, str]
    workdir: Path

    def audit(self, machine: str, run_id: str, tool_use_id: str) -> dict[str, Any]:
        # A wait that expired is audited by its machine once the coordinator tells it,
        # just after the call's outcome: give that line a moment.
        path = self.workdir / f"audit-{machine}.log"
        give_up = time.monotonic() + 10
        while True:
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            found = [x for x in lines if (x["run_id"], x["tool_use_id"]) == (run_id, tool_use_id)]
            if found or time.monotonic() > give_up:
                break
            time.sleep(0.05)
        assert len(found) == 1, found
        return found[0]


def iso_machines(workdir: Path) -> dict[str, dict[str, str]]:
    policy = workdir / "policy.toml"
    policy.write_text(POLICY)

    def machine(name: str, mode: str, **extra: str) -> dict[str, str]:
        return {
            "CMDOP_PERMISSION_MODE": mode,
            "CMDOP_AUDIT_LOG": str(workdir / f"audit-{name}.log"),
            "CMDOP_POLICY_FILE": str(policy),
            **extra,
        }

    return {
        "doomed": machine("doomed", "bypass"),
        "p-ask": machine("p-ask", "default", CMDOP_APPROVAL_TIMEOUT_S=str(ASK_WAIT_S)),
        "p-default": machine("p-default", "default", CMDOP_APPROVAL_TIMEOUT_S="1.5"),
        "p-strict": machine("p-strict", "strict"),
        "p-bypass": machine(
            "p-bypass",
            "bypass",
            CMDOP_TOOL_MODULES='["tests.integration.user_tools"]',
            PYTHONPATH=str(repo_root()),
        ),
    }


@pytest.fixture(scope="module")
def iso(fleet_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Iso]:
    workdir = tmp_path_factory.mktemp("iso")
    server = RedisServer().start()
    env = {**fleet_env, "CMDOP_REDIS_URL": server.url}
    env.pop("CMDOP_AUDIT_LOG")
    local = LocalFleet(env, logdir=tmp_path_factory.mktemp("iso-logs"))
    machines = iso_machines(workdir)
    try:
        local.start_coordinator()
        for name, extra in machines.items():
            local.start_machine(name, extra)
        local.wait_ready(list(machines), timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield Iso(local, client, env, workdir)
    finally:
        local.stop()
        server.stop()


# --- presence and routing ------------------------------------------------------------------


def test_each_call_runs_on_the_machine_it_names(client, fleet, script) -> None:
    prompt = script(
        calls_then_report(
            use("execute_command", machine="beta", command=MARK),
            use("execute_command", machine="alpha", command=MARK),
            use("execute_command", machine="beta", command=MARK),
        )
    )
    done = finish(client, prompt)
    assert done.result.status == "done"
    starts = {e.data["tool_call_id"]: e.data["machine"] for e in done.of("TOOL_START")}
    ends = done.ends_in_call_order()
    assert [e.data["machine"] for e in ends] == ["beta", "alpha", "beta"]
    for end in ends:
        machine = end.data["machine"]
        assert starts[end.data["tool_call_id"]] == machine
        assert f"mark-{machine}" in end.data["output"]


def test_presence_key_holds_tools_host_and_pid(client, fleet) -> None:
    for machine in ("alpha", "beta"):
        key = client.keys.machine(machine)
        presence = json.loads(client.redis.get(key))
        assert presence["machine"] == machine
        assert presence["pid"] == fleet.workers[machine].pid
        assert presence["host"] == os.uname().nodename
        assert sorted(t["name"] for t in presence["tools"]) == BUILTINS
        ttl_ms = client.redis.pttl(key)
        assert 0 < ttl_ms <= float(fleet.env["CMDOP_PRESENCE_TTL_S"]) * 1000


def test_machines_command_lists_online_machines_and_tools(fleet, fleet_env) -> None:
    done = cli({"CMDOP_REDIS_URL": fleet_env["CMDOP_REDIS_URL"]}, "machines")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if "execute_command" in line}
    assert {"alpha", "beta"} <= set(rows), done.stdout
    for machine in ("alpha", "beta"):
        assert str(fleet.workers[machine].pid) in rows[machine]
        for name in BUILTINS:
            assert name in rows[machine]


def test_list_machines_tool_shows_machines_and_tools(client, fleet, script) -> None:
    prompt = script(calls_then_report(use("list_machines")))
    done = finish(client, prompt)
    (end,) = done.ends
    assert not end.data["is_error"], end.data
    listed = {m["machine"]: m for m in json.loads(end.data["output"])}
    assert {"alpha", "beta"} <= set(listed)
    assert sorted(listed["alpha"]["tools"]) == BUILTINS
    assert listed["beta"]["host"] == os.uname().nodename
    assert done.result.status == "done"


def test_a_malformed_or_newer_presence_does_not_break_the_fleet(client, fleet, script) -> None:
    alpha = json.loads(client.redis.get(client.keys.machine("alpha")))
    newer = {**alpha, "machine": "newer", "labels": {"rack": "b"}}  # a field added later
    newer["tools"] = [{**t, "timeout_hint_ms": 5} for t in alpha["tools"]]
    client.redis.set(client.keys.machine("garbled"), "{not json", px=20_000)
    client.redis.set(client.keys.machine("newer"), json.dumps(newer), px=20_000)
    client.redis.sadd(client.keys.machines_index, "garbled", "newer")  # as a heartbeat does
    try:
        prompt = script(calls_then_report(use("list_machines")))
        done = finish(client, prompt)
        listed = [m["machine"] for m in json.loads(done.ends[0].data["output"])]
        machines = [p.machine for p in client.machines()]
    finally:
        client.redis.delete(client.keys.machine("garbled"), client.keys.machine("newer"))
    assert done.result.status == "done"
    assert {"alpha", "beta", "newer"} <= set(listed) and "garbled" not in listed
    assert {"alpha", "beta", "newer"} <= set(machines) and "garbled" not in machines


def test_catalogue_gives_machine_bound_tools_a_machine_enum(client, script) -> None:
    prompt = script([[{"type": "text", "text": "nothing to do"}]])
    finish(client, prompt)
    online = [p.machine for p in client.machines()]
    (request,) = script.requests_for(prompt)
    for name in BUILTINS:
        schema = tool_spec(request, name)["input_schema"]
        assert schema["properties"]["machine"]["enum"] == online
        assert "default" not in schema["properties"]["machine"]
        assert "machine" in schema["required"]
    assert "machine" not in tool_spec(request, "list_machines")["input_schema"]["properties"]


def test_target_machine_makes_machine_optional_with_a_default(client, script) -> None:
    prompt = script(
        calls_then_report(
            use("execute_command", command=MARK), use("execute_command", command=MARK, machine=None)
        )
    )
    done = finish(client, prompt, machine="beta")
    first = script.requests_for(prompt)[0]
    for name in BUILTINS:
        schema = tool_spec(first, name)["input_schema"]
        assert schema["properties"]["machine"]["default"] == "beta"
        assert "machine" not in schema.get("required", [])
        assert "beta" in schema["properties"]["machine"]["enum"]
    assert len(done.ends) == 2
    for end in done.ends:
        assert end.data["machine"] == "beta" and "mark-beta" in end.data["output"]


@pytest.mark.parametrize(
    ("tool_input", "run_machine", "offline"),
    [
        ({"machine": "ghost", "command": "echo hi"}, None, "ghost"),
        ({"command": "echo hi"}, "ghost", "ghost"),
        ({"machine": "zz-never-existed", "command": "echo hi"}, "alpha", "zz-never-existed"),
    ],
)
def test_offline_machine_fails_fast(client, settings, script, tool_input, run_machine, offline):
    prompt = script(calls_then_report(use("execute_command", **tool_input)))
    started = time.monotonic()
    done = finish(client, prompt, machine=run_machine)
    elapsed_s = time.monotonic() - started
    (end,) = done.ends
    # "offline" is only answered by routing, before anything is sent to a machine queue.
    assert end.data["is_error"] and end.data["status"] == "offline"
    assert end.data["output"] == f"machine {offline} is offline"
    assert done.result.status == "done"
    # A call sent to a queue nobody consumes would wait for the tool deadline.
    assert elapsed_s < settings.tool_timeout_ms / 1000


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
    assert client.store.record_outcome(run_id, 1, first) is Recorded.STORED
    _send_direct(client, run_id, "toolu_again", f"touch {marker}")
    _send_direct(client, run_id, "toolu_probe", "true")  # alpha takes calls in order
    wait_for(lambda: client.store.outcome(run_id, 1, "toolu_probe"), 20, "the next call")
    assert not marker.exists()
    assert client.store.outcome(run_id, 1, "toolu_again") == first
    assert not client.store.was_started(run_id, "toolu_again")
    ids = [e.data["tool_call_id"] for e in client.events(run_id, idle_timeout_s=1)]
    assert ids == ["toolu_probe", "toolu_probe"]


# --- bad calls ----------------------------------------------------------------------------


def test_hallucinated_tool_is_an_error_result_and_the_run_goes_on(client, script) -> None:
    prompt = script(
        calls_then_report(use("frobnicate_cluster", machine="alpha"), use("list_machines"))
    )
    done = finish(client, prompt)
    assert done.result.status == "done" and done.result.turns == 2
    bad, good = done.ends_in_call_order()
    assert bad.data["is_error"] and bad.data["output"] == "tool 'frobnicate_cluster' does not exist"
    assert not good.data["is_error"]
    assert "does not exist" in done.result.text


@pytest.mark.parametrize(
    ("tool_input", "problem"),
    [
        ({"machine": "alpha"}, "invalid arguments for read_file: path: Field required"),
        ({"machine": "alpha", "path": 42}, "path: Input should be a valid string"),
        ({"machine": "alpha", "path": "/etc/hostname", "limit": 0}, "limit: Input should be"),
        ({"machine": "alpha", "path": "/etc/hostname", "colour": 1}, "colour: Extra inputs"),
        ({"machine": 7, "path": "/etc/hostname"}, "'7' is not a valid machine name"),
    ],
)
def test_schema_violations_are_error_results_naming_the_problem(
    client, script, tool_input, problem
) -> None:
    prompt = script(calls_then_report(use("read_file", **tool_input)))
    done = finish(client, prompt)
    (end,) = done.ends
    assert end.data["is_error"] and end.data["status"] == "invalid"
    assert problem in end.data["output"]
    assert done.result.status == "done"


@pytest.mark.parametrize("raw", ['["a", "b"]', '"just text"', "{not json"])
def test_non_object_input_is_an_error_naming_the_problem(raw) -> None:
    # The model API only yields objects (the coordinator repairs anything else before
    # routing); the machine side must still answer a raw non-object with data.
    import threading

    ctx = ToolContext(
        machine="alpha",
        run_id="r",
        tool_use_id="toolu_raw",
        deadline_monotonic=time.monotonic() + 5,
        cancelled=threading.Event(),
    )
    outcome = default_registry().run("read_file", raw, ctx)
    assert outcome.status == "invalid"
    assert outcome.output.startswith("invalid ")
    assert "read_file" in outcome.output


# --- ask_machine(s) -------------------------------------------------------------------------


def child_script(script) -> str:
    return script(
        [
            [use("execute_command", command="echo $CMDOP_TEST_MACHINE_MARK")],
            [{"type": "text", "text": "child says {{result:0}}"}],
        ]
    )


def test_ask_machine_returns_the_child_answer_from_a_targeted_run(client, script) -> None:
    child = child_script(script)
    prompt = script(calls_then_report(use("ask_machine", machine="beta", prompt=child)))
    done = finish(client, prompt)
    assert done.result.status == "done"
    (end,) = done.ends
    assert not end.data["is_error"], end.data
    assert end.data["output"].startswith("child says exit_code: 0")
    assert "mark-beta" in end.data["output"]
    assert "mark-beta" in done.result.text
    child_requests = script.requests_for(child)
    assert len(child_requests) == 2
    for request in child_requests:
        assert "Your client is asking about beta" in json.dumps(request["body"]["messages"])
        machine_arg = tool_spec(request, "execute_command")["input_schema"]["properties"]
        assert machine_arg["machine"]["default"] == "beta"


def test_ask_machine_offline_fails_fast(client, script) -> None:
    child = f"hello {uuid.uuid4().hex}"
    prompt = script(calls_then_report(use("ask_machine", machine="ghost", prompt=child)))
    started = time.monotonic()
    done = finish(client, prompt)
    (end,) = done.ends
    assert end.data["is_error"]
    assert end.data["output"] == "ghost: local_error: machine ghost is offline"
    # Answered locally: no child run was started, so the model never saw its prompt.
    assert not client.redis.exists(client.keys.run(done.run.run_id, "children"))
    assert script.requests_for(child) == []
    # A child run on a machine nobody serves would wait for the ask's deadline.
    assert time.monotonic() - started < ASK_TIMEOUT_DEFAULT_MS / 1000


def test_ask_machine_that_runs_out_of_time_answers_timeout(client, fleet, script) -> None:
    timeout_ms = 1_500
    grace_ms = int(fleet.env["CMDOP_TOOL_GRACE_MS"])
    child = script(
        [
            [use("execute_command", command="sleep 30", timeout_ms=60_000)],
            [{"type": "text", "text": "child finished"}],
        ]
    )
    prompt = script(
        calls_then_report(use("ask_machine", machine="alpha", prompt=child, timeout_ms=timeout_ms))
    )
    done = finish(client, prompt)
    assert done.result.status == "done"
    (start,) = done.of("TOOL_START")
    (end,) = done.ends
    # Only the ask's timeout gives this answer; the child's own command would run 30 s.
    assert end.data["is_error"] and end.data["output"] == "alpha: local_error: timeout"
    assert end.ts_ms - start.ts_ms < 3 * (timeout_ms + grace_ms)


def test_ask_machines_answers_per_host_in_order(client, script) -> None:
    child = child_script(script)
    hosts = ["alpha", "ghost", "alpha", "beta"]
    prompt = script(calls_then_report(use("ask_machines", machines=hosts, prompt=child)))
    done = finish(client, prompt)
    assert done.result.status == "done"
    (end,) = done.ends
    assert not end.data["is_error"], end.data
    answers = json.loads(end.data["output"])
    assert [a["host"] for a in answers] == ["alpha", "ghost", "beta"]
    alpha, ghost, beta = answers
    assert alpha["status"] == "response" and "mark-alpha" in alpha["text"]
    assert beta["status"] == "response" and "mark-beta" in beta["text"]
    assert ghost == {"host": "ghost", "status": "local_error", "error": "machine ghost is offline"}
    children = client.redis.smembers(client.keys.run(done.run.run_id, "children"))
    assert len(children) == 2  # one child per online host, duplicates asked once


def test_cancelling_the_parent_cancels_its_children(client, script) -> None:
    child = script(
        [
            [use("execute_command", command="sleep 30", timeout_ms=60_000)],
            [{"type": "text", "text": "child finished"}],
        ]
    )
    prompt = script(calls_then_report(use("ask_machine", machine="alpha", prompt=child)))
    parent = client.submit(prompt=prompt)
    children_key = client.keys.run(parent.run_id, "children")
    child_id = wait_for(lambda: client.redis.smembers(children_key), 20, "the child run")
    (child_id,) = child_id
    child_run = client.run(child_id)
    for event in child_run.events(idle_timeout_s=20):
        if event.type == "TOOL_START":
            break
    assert parent.cancel(ui=True)

    parent_result = parent.wait(timeout=15, raise_on_failure=False)
    child_result = child_run.wait(timeout=15, raise_on_failure=False)
    assert parent_result.status == "cancelled"
    assert child_result.status == "cancelled"
    assert child_result.cancel is not None and child_result.cancel.channel == "ui"
    (child_tool,) = tool_results(child_result).values()
    assert child_tool["is_error"] and "cancelled" in child_tool["content"]
    (parent_tool,) = tool_results(parent_result).values()
    assert parent_tool["is_error"] and "cancelled" in parent_tool["content"]


# --- the isolated fleet: a machine lost mid-call ---------------------------------------------


def test_machine_killed_mid_call_is_lost_and_the_run_goes_on(iso, script) -> None:
    token = f"27.{uuid.uuid4().int % 1000:03d}"
    timeout_ms = 3_000
    grace_ms = int(iso.env["CMDOP_TOOL_GRACE_MS"])
    ttl_s = float(iso.env["CMDOP_PRESENCE_TTL_S"])
    call = use("execute_command", machine="doomed", command=f"sleep {token}", timeout_ms=timeout_ms)
    prompt = script([[call], [{"type": "text", "text": "after the loss: {{result:0}}"}]])
    killer = Killer(iso, "doomed", ttl_s, token)
    try:
        done = finish(iso.client, prompt, killer.on_event)
    finally:
        _kill_orphan_sleep(token)
    assert done.result.status == "done"
    (start,) = done.of("TOOL_START")
    (end,) = done.ends
    assert end.data["status"] == "lost"
    assert end.data["output"] == "started on doomed; outcome unknown; machine lost"
    # Declared lost long before the orphaned sleep (27 s) could have answered.
    assert end.ts_ms - start.ts_ms < 3 * (timeout_ms + grace_ms)
    assert done.result.text == "after the loss: started on doomed; outcome unknown; machine lost"
    # The presence key carried the configured TTL when the worker died, and expired.
    assert killer.ttl_ms_at_kill is not None and 0 < killer.ttl_ms_at_kill <= ttl_s * 1000
    assert killer.presence_expired


@dataclass
class Killer:
    """SIGKILLs a machine worker once its command runs, then waits its presence out."""

    iso: Iso
    machine: str
    ttl_s: float
    token: str
    ttl_ms_at_kill: int | None = None
    presence_expired: bool = False

    def on_event(self, run: Run, event: Event) -> None:
        if event.type != "TOOL_START":
            return
        wait_for(lambda: _sleep_pids(self.token), 20, "the command's start")
        redis = self.iso.client.redis
        key = self.iso.client.keys.machine(self.machine)
        self.ttl_ms_at_kill = redis.pttl(key)
        self.iso.fleet.workers[self.machine].kill()
        wait_for(lambda: not redis.exists(key), 5 * self.ttl_s, "presence expiry")
        self.presence_expired = True


def _sleep_pids(token: str) -> list[int]:
    """Pids of running `sleep <token>` processes."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"sleep", token.encode()]:
            pids.append(int(proc.name))
    return pids


def _kill_orphan_sleep(token: str) -> None:
    """The killed worker's `sleep` lives on in its own session: end it by pid."""
    for pid in _sleep_pids(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# --- the isolated fleet: permissions -----------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "tool", "tool_input", "status", "verdict", "source", "final"),
    [
        ("p-bypass", "read_file", {"path": "{dir}/.env"}, "denied", "deny", "floor", "deny"),
        ("p-bypass", "execute_command", {"command": "rm -rf /"}, "denied", "deny", "floor", "deny"),
        (
            "p-bypass",
            "execute_command",
            {"command": "echo forbidden-x"},
            "denied",
            "deny",
            "rule",
            "deny",
        ),
        (
            "p-bypass",
            "execute_command",
            {"command": "echo bypassed"},
            "ok",
            "allow",
            "mode",
            "allow",
        ),
        (
            "p-strict",
            "execute_command",
            {"command": "echo strict-no-rule"},
            "denied",
            "deny",
            "mode",
            "deny",
        ),
        (
            "p-strict",
            "execute_command",
            {"command": "echo allowed-here"},
            "ok",
            "allow",
            "rule",
            "allow",
        ),
        ("p-strict", "read_file", {"path": "{dir}/plain.txt"}, "ok", "allow", "rule", "allow"),
    ],
)
def test_permission_outcome_and_audit_line(
    iso, script, host_dir, machine, tool, tool_input, status, verdict, source, final
) -> None:
    (host_dir / ".env").write_text("SECRET=do-not-show\n")
    (host_dir / "plain.txt").write_text("plain words\n")
    tool_input = {k: v.replace("{dir}", str(host_dir)) for k, v in tool_input.items()}
    prompt = script(calls_then_report(use(tool, machine=machine, **tool_input)))
    done = finish(iso.client, prompt)
    assert done.result.status == "done"
    (end,) = done.ends
    assert end.data["status"] == status, end.data
    assert "do-not-show" not in end.data["output"]
    if status == "denied":
        assert end.data["output"].startswith("permission denied: ")
    line = iso.audit(machine, done.run.run_id, end.data["tool_call_id"])
    assert (line["verdict"], line["source"], line["final"]) == (verdict, source, final)
    assert line["tool"] == tool and line["machine"] == machine


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A directory the machines' sandboxes see (their /tmp is private)."""
    path = Path(f"/var/tmp/cmdop-iso-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _ask_and_answer(iso, script, machine: str, command: str, answer: Callable[[Run, str], None]):
    prompt = script(calls_then_report(use("execute_command", machine=machine, command=command)))
    asked: list[Event] = []

    def on_event(run: Run, event: Event) -> None:
        if event.type == "APPROVAL_REQUEST":
            asked.append(event)
            answer(run, event.data["tool_call_id"])

    done = finish(iso.client, prompt, on_event)
    assert len(asked) == 1 and asked[0].data["machine"] == machine
    (end,) = done.ends
    return done, end, iso.audit(machine, done.run.run_id, end.data["tool_call_id"])


def test_ask_rule_approved_through_the_cli_runs_the_call(iso, script) -> None:
    def approve_with_cli(run: Run, tool_call_id: str) -> None:
        out = cli(
            {"CMDOP_REDIS_URL": iso.env["CMDOP_REDIS_URL"]}, "approve", run.run_id, tool_call_id
        )
        assert out.returncode == 0, out.stderr

    done, end, line = _ask_and_answer(iso, script, "p-ask", "echo ask-me please", approve_with_cli)
    assert end.data["status"] == "ok" and "ask-me please" in end.data["output"]
    assert (line["verdict"], line["source"], line["final"]) == ("ask", "rule", "approved")
    assert done.result.status == "done"


def test_ask_rule_denied_by_the_client_is_refused(iso, script) -> None:
    def deny(run: Run, tool_call_id: str) -> None:
        run.approve(tool_call_id, approve=False)

    _, end, line = _ask_and_answer(iso, script, "p-ask", "echo ask-me twice", deny)
    assert end.data["status"] == "denied"
    assert end.data["output"].startswith("permission denied by a person")
    assert (line["verdict"], line["source"], line["final"]) == ("ask", "rule", "denied")


def test_mode_default_asks_and_nobody_answering_denies(iso, script) -> None:
    def ignore(run: Run, tool_call_id: str) -> None:
        pass

    done, end, line = _ask_and_answer(iso, script, "p-default", "echo nobody-home", ignore)
    assert end.data["status"] == "denied"
    assert end.data["output"] == f"permission denied: nobody approved within {NO_ANSWER_WAIT_S:g} s"
    assert (line["verdict"], line["source"], line["final"]) == ("ask", "mode", "timeout")
    (asked,) = done.of("APPROVAL_REQUEST")
    assert asked.data["timeout_s"] == NO_ANSWER_WAIT_S


# --- the isolated fleet: a user-registered tool -------------------------------------------------


def test_user_tool_is_advertised_and_callable(iso, script) -> None:
    presence = json.loads(iso.client.redis.get(iso.client.keys.machine("p-bypass")))
    (spec,) = [t for t in presence["tools"] if t["name"] == "shout"]
    assert spec["tags"] == ["custom"] and spec["core"] is True and spec["machine_bound"] is True
    assert set(spec["input_schema"]["properties"]) == {"text", "times"}
    others = json.loads(iso.client.redis.get(iso.client.keys.machine("p-strict")))
    assert "shout" not in {t["name"] for t in others["tools"]}

    prompt = script(
        calls_then_report(
            use("shout", machine="p-bypass", text="hello", times=2),
            use("shout", machine="p-bypass", text="hello", times=9),
            use("shout", machine="p-strict", text="hello"),
        )
    )
    done = finish(iso.client, prompt)
    ok, invalid, elsewhere = done.ends_in_call_order()
    assert ok.data["output"] == "HELLO HELLO (on p-bypass)" and not ok.data["is_error"]
    assert invalid.data["status"] == "invalid" and "times:" in invalid.data["output"]
    assert elsewhere.data["output"] == "machine p-strict does not offer shout"
    schema = tool_spec(script.requests_for(prompt)[0], "shout")["input_schema"]
    assert schema["properties"]["machine"]["enum"] == ["p-bypass"]
