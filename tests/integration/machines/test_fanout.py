"""One call, many machines, through real machine workers in label groups (a fleet of its
own): one copy per matching machine, each under its own machine's gate, one
TOOL_START/TOOL_END per copy naming its machine, no copy run twice, and one tool_result
that groups the machines by outcome — a policy's denial, a machine gone before it ran
its copy, a copy that timed out."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.core.fanout import copy_id
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer

from .machine_runs import finish, tool_results, use

pytestmark = pytest.mark.integration

# name -> (labels, extra environment)
MACHINES: dict[str, tuple[list[str], dict[str, str]]] = {
    "fo-web-1": (["role=web", "env=prod"], {}),
    "fo-web-2": (["role=web", "env=prod"], {}),
    "fo-web-3": (["role=web", "env=staging"], {"CMDOP_PERMISSION_MODE": "strict"}),
    "fo-db-1": (["role=db", "env=prod"], {}),
    "fo-db-slow": (["role=db", "env=prod"], {"CMDOP_TEST_MACHINE_MARK": "slow"}),
    # Killed before the run: its presence outlives it long enough to be selected.
    "fo-gone": (["role=db", "env=prod"], {"CMDOP_PRESENCE_TTL_S": "8"}),
}
# The same command everywhere; the machine marked slow outlives the call's timeout.
COMMAND = '[ "$CMDOP_TEST_MACHINE_MARK" = slow ] && sleep 20; echo fanout-ok'
TIMEOUT_MS = 2_500


@dataclass
class FanFleet:
    fleet: LocalFleet
    client: Client


@pytest.fixture(scope="module")
def fan(fleet_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[FanFleet]:
    server = RedisServer().start()
    env = {**fleet_env, "CMDOP_REDIS_URL": server.url, "CMDOP_WORKER_CONCURRENCY": "2"}
    local = LocalFleet(env, logdir=tmp_path_factory.mktemp("fanout-logs"))
    try:
        local.start_coordinator()
        for name, (labels, extra) in MACHINES.items():
            local.start_machine(name, extra, labels=labels)
        local.wait_ready(list(MACHINES), timeout_s=90)
        with Client(Settings(redis_url=server.url)) as client:
            yield FanFleet(local, client)
    finally:
        local.stop()
        server.stop()


def test_a_fan_out_across_label_groups(fan: FanFleet, script) -> None:
    fan.fleet.workers["fo-gone"].kill()
    call = use("execute_command", machines="env=prod,role in (web,db)", command=COMMAND)
    call["input"]["timeout_ms"] = TIMEOUT_MS
    call_staging = use("execute_command", machines="env=staging", command="echo fanout-ok")
    prompt = script([[call, call_staging], [{"type": "text", "text": "{{results}}"}]])
    done = finish(fan.client, prompt)
    assert done.result.status == "done"

    tool_use_ids = [
        b["id"]
        for m in done.result.messages
        if m.role == "assistant" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_use"
    ]
    fan_id, staging_id = tool_use_ids
    prod = ["fo-db-1", "fo-db-slow", "fo-gone", "fo-web-1", "fo-web-2"]
    copies = {copy_id(fan_id, m): m for m in prod} | {copy_id(staging_id, "fo-web-3"): "fo-web-3"}

    # One TOOL_START and one TOOL_END per copy, each naming its machine; no copy twice.
    starts = collections.Counter(e.data["tool_call_id"] for e in done.of("TOOL_START"))
    ends = {e.data["tool_call_id"]: e.data for e in done.ends}
    assert starts == collections.Counter(list(copies))
    assert set(ends) == set(copies) and len(done.ends) == len(copies)
    for cid, machine in copies.items():
        assert ends[cid]["machine"] == machine
    statuses = {copies[cid]: data["status"] for cid, data in ends.items()}
    assert statuses == {
        "fo-db-1": "ok",
        "fo-web-1": "ok",
        "fo-web-2": "ok",
        "fo-db-slow": "timeout",
        "fo-gone": "offline",
        "fo-web-3": "denied",
    }

    # The model read one result per call, machines grouped by outcome.
    results = tool_results(done.result)
    assert set(results) == {fan_id, staging_id}
    lines = results[fan_id]["content"].splitlines()
    assert lines[0] == "execute_command on 5 machines: 3 ok, 1 offline, 1 timeout"
    assert lines[1] == 'fo-db-1, fo-web-1, fo-web-2 (3): ok, exit 0: "fanout-ok"'
    gone = ends[copy_id(fan_id, "fo-gone")]["output"]
    assert f'fo-gone (1): offline: "{gone}"' in lines
    assert any(line.startswith("fo-db-slow (1): timeout") for line in lines)
    assert len(lines) == 4 and "is_error" not in results[fan_id]
    staging = results[staging_id]
    assert staging["is_error"] is True
    assert staging["content"].splitlines()[0] == "execute_command on 1 machine: 1 denied"
    assert staging["content"].splitlines()[1].startswith("fo-web-3 (1): denied: ")


def test_a_selector_matching_no_machine_names_the_label_groups(fan: FanFleet, script) -> None:
    call = use("execute_command", machines="role=cache", command="echo x")
    bad = use("execute_command", machines="role in (", command="echo x")
    both = use("execute_command", machines="role=web", machine="fo-web-1", command="echo x")
    prompt = script([[call, bad, both], [{"type": "text", "text": "{{results}}"}]])
    done = finish(fan.client, prompt, max_fanout=2)
    assert done.result.status == "done"
    texts = [r["content"] for r in tool_results(done.result).values()]
    assert any(
        t.startswith("no machine online matches the selector 'role=cache'; label groups online:")
        and "role=web (3)" in t
        for t in texts
    )
    assert any(t.startswith("'machines': bad selector 'role in ('") for t in texts)
    assert any("not both" in t for t in texts)
    assert all(len(e.data["tool_call_id"].split("@")) == 1 for e in done.ends)


def test_more_machines_than_max_fanout_is_refused(fan: FanFleet, script) -> None:
    call = use("execute_command", machines="role=web", command="echo x")
    prompt = script([[call], [{"type": "text", "text": "{{results}}"}]])
    done = finish(fan.client, prompt, max_fanout=2)
    (result,) = tool_results(done.result).values()
    assert result["is_error"] is True
    assert "matches 3 machines, more than this run's max_fanout (2)" in result["content"]
    assert not [e for e in done.of("TOOL_START") if e.data.get("machine")]


def test_ask_machines_takes_a_selector(fan: FanFleet, script) -> None:
    child = script(
        [
            [use("execute_command", command="echo child-here")],
            [{"type": "text", "text": "child says {{result:0}}"}],
        ]
    )
    ask = use("ask_machines", machines="role=web,env=prod", prompt=child)
    none = use("ask_machines", machines="role=cache", prompt=child)
    prompt = script([[ask, none], [{"type": "text", "text": "{{results}}"}]])
    done = finish(fan.client, prompt)
    assert done.result.status == "done"
    asked, unmatched = (e.data for e in done.ends_in_call_order())
    answers = json.loads(asked["output"])
    assert [a["host"] for a in answers] == ["fo-web-1", "fo-web-2"]
    assert all(a["status"] == "response" and "child-here" in a["text"] for a in answers)
    assert unmatched["is_error"] and unmatched["output"].startswith(
        "no machine online matches the selector 'role=cache'; label groups online:"
    )
