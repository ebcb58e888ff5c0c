"""Presence and routing against the session fleet (`alpha`, `beta`): each call runs on
the machine it names, presence holds what a machine offers, the catalogue's plain
`machine` string (no list of machines), the run's target as the default, and an
offline machine answered at once."""

from __future__ import annotations

import json
import os
import time

import pytest

from cmdop_worker.models import MachinePresence
from cmdop_worker.state.presence import announce, leave

from .machine_runs import (
    BUILTINS,
    MARK,
    calls_then_report,
    cli,
    finish,
    tool_spec,
    use,
)

pytestmark = pytest.mark.integration


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


def test_catalogue_gives_machine_bound_tools_a_plain_machine_string(client, script) -> None:
    prompt = script([[{"type": "text", "text": "nothing to do"}]])
    finish(client, prompt)
    (request,) = script.requests_for(prompt)
    for name in BUILTINS:
        machine = tool_spec(request, name)["input_schema"]["properties"]["machine"]
        assert machine["type"] == "string" and "list_machines" in machine["description"]
        assert "enum" not in machine and "default" not in machine
    assert "machine" not in tool_spec(request, "list_machines")["input_schema"]["properties"]


def test_target_machine_is_the_default_and_the_tools_are_the_same(client, script) -> None:
    prompt = script(
        calls_then_report(
            use("execute_command", command=MARK), use("execute_command", command=MARK, machine=None)
        )
    )
    done = finish(client, prompt, machine="beta")
    untargeted = script([[{"type": "text", "text": "nothing to do"}]])
    finish(client, untargeted)
    first = script.requests_for(prompt)[0]
    assert first["body"]["tools"] == script.requests_for(untargeted)[0]["body"]["tools"]
    for name in BUILTINS:
        assert "machine" not in tool_spec(first, name)["input_schema"].get("required", [])
    assert len(done.ends) == 2
    for end in done.ends:
        assert end.data["machine"] == "beta" and "mark-beta" in end.data["output"]


@pytest.mark.parametrize(
    ("tool_input", "run_machine", "offline"),
    [
        ({"machine": "gone-ghost", "command": "echo hi"}, None, "gone-ghost"),
        ({"command": "echo hi"}, "gone-ghost", "gone-ghost"),
        ({"machine": "zz-gone", "command": "echo hi"}, "alpha", "zz-gone"),
    ],
)
def test_offline_machine_fails_fast(client, settings, script, tool_input, run_machine, offline):
    # Known (it joined once) and offline now; a name never seen is "unknown" instead
    # (tests/integration/test_machines_known.py).
    gone = MachinePresence(machine=offline, host="h", pid=1, started_ms=0, tools=[])
    announce(client.redis, client.keys, gone, ttl_ms=60_000)
    leave(client.redis, client.keys, offline)
    prompt = script(calls_then_report(use("execute_command", **tool_input)))
    started = time.monotonic()
    done = finish(client, prompt, machine=run_machine)
    elapsed_s = time.monotonic() - started
    (end,) = done.ends
    # "offline" is only answered by routing, before anything is sent to a machine queue.
    assert end.data["is_error"] and end.data["status"] == "offline"
    assert end.data["output"].startswith(f"machine {offline} is offline; ")
    assert done.result.status == "done"
    # A call sent to a queue nobody consumes would wait for the tool deadline.
    assert elapsed_s < settings.tool_timeout_ms / 1000
