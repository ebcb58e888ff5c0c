"""One call, many machines, through real machine workers in label groups (a fleet of its
own): one copy per matching machine, each under its own machine's gate, one
TOOL_START/TOOL_END per copy naming its machine, no copy run twice, and one tool_result
that groups the machines by outcome — a policy's denial, a machine gone before it ran
its copy, a copy that timed out."""

from __future__ import annotations

import collections
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.coordinator.runs import initial_state
from cmdop_worker.core.event_data import ToolStartData
from cmdop_worker.core.fanout import copy_id, copy_input
from cmdop_worker.core.intake import parse_request
from cmdop_worker.models import Message
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.keys import advance_member
from cmdop_worker.state.store import PendingCall, Started
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer

from .machine_runs import finish, tool_results, use

pytestmark = pytest.mark.integration

# name -> (labels, extra environment)
MACHINES: dict[str, tuple[list[str], dict[str, str]]] = {
    "fo-web-1": (["role=web", "env=prod", "batch=yes"], {}),
    "fo-web-2": (["role=web", "env=prod", "batch=yes"], {}),
    "fo-web-3": (["role=web", "env=staging"], {"CMDOP_PERMISSION_MODE": "strict"}),
    "fo-db-1": (["role=db", "env=prod", "batch=yes"], {}),
    "fo-db-slow": (["role=db", "env=prod", "batch=yes"], {"CMDOP_TEST_MACHINE_MARK": "slow"}),
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
    rt: Runtime


@pytest.fixture(scope="module")
def fan(fleet_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[FanFleet]:
    server = RedisServer().start()
    env = {**fleet_env, "CMDOP_REDIS_URL": server.url, "CMDOP_WORKER_CONCURRENCY": "2"}
    local = LocalFleet(env, logdir=tmp_path_factory.mktemp("fanout-logs"))
    try:
        local.start_coordinator()
        for name, (labels, extra) in MACHINES.items():
            mark = {"CMDOP_TEST_MACHINE_MARK": f"mark-{name}"}
            local.start_machine(name, {**mark, **extra}, labels=labels)
        local.wait_ready(list(MACHINES), timeout_s=90)
        rt = Runtime(Settings(redis_url=server.url))
        try:
            with Client(Settings(redis_url=server.url)) as client:
                yield FanFleet(local, client, rt)
        finally:
            rt.close()
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
    state = fan.client.store.load(done.result.run_id)
    assert state is not None and state.copy_key  # each copy's id is keyed by the run
    key = state.copy_key
    copies = {copy_id(fan_id, m, key): m for m in prod} | {
        copy_id(staging_id, "fo-web-3", key): "fo-web-3"
    }
    # A machine knows its own copy's id, never the key: it cannot derive another's.
    assert copy_id(fan_id, "fo-web-2") not in copies

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
    gone = ends[copy_id(fan_id, "fo-gone", key)]["output"]
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


def test_a_ui_cancel_kills_every_running_copy(fan: FanFleet, script) -> None:
    call = use("execute_command", machines="env=prod,role=web", command="sleep 30")
    call["input"]["timeout_ms"] = 60_000
    prompt = script([[call], [{"type": "text", "text": "not reached"}]])
    run = fan.client.submit(prompt=prompt)
    started: set[str] = set()
    events = []
    for event in run.events(idle_timeout_s=30):
        events.append(event)
        if event.type == "TOOL_START":
            started.add(event.data["machine"])
            if started == {"fo-web-1", "fo-web-2"}:
                fan.client.cancel(run.run_id, ui=True)
    result = run.wait(timeout=10, raise_on_failure=False)
    assert result.status == "cancelled"
    ends = {e.data["machine"]: e.data for e in events if e.type == "TOOL_END"}
    assert set(ends) == {"fo-web-1", "fo-web-2"}
    assert all(end["status"] == "cancelled" for end in ends.values())
    assert all(end["duration_ms"] < 20_000 for end in ends.values())


def test_a_fan_out_cut_short_by_a_dead_coordinator_runs_each_copy_once(
    fan: FanFleet, script, tmp_path: Path
) -> None:
    """The turn stored its reply and its copies, one copy started (and its machine went
    quiet), and the coordinator died: recovery sends only the copy that never started,
    the watchdog answers the other, and the model reads one result."""
    effects = tmp_path / "effects"
    effects.touch(mode=0o666)
    rt = fan.rt
    prompt = script(
        [[{"type": "text", "text": "unused"}], [{"type": "text", "text": "{{results}}"}]]
    )
    run_id = f"fan-cut-{uuid.uuid4().hex[:10]}"
    state = initial_state(rt, parse_request({"prompt": prompt}), run_id)
    args = {
        "machines": "env=prod,role=web",
        "command": f"echo $CMDOP_TEST_MACHINE_MARK >> {effects}",
    }
    block = {"type": "tool_use", "id": "toolu_fan_cut", "name": "execute_command", "input": args}
    machines = ["fo-web-1", "fo-web-2"]
    awaiting = [
        PendingCall(
            tool_use_id=copy_id("toolu_fan_cut", m),
            tool="execute_command",
            machine=m,
            deadline_ms=now_ms() + 6_000,
        )
        for m in machines
    ]
    history = [*state.history, Message(role="assistant", content=[block])]
    state = state.model_copy(update={"turn": 1, "history": history, "awaiting": awaiting})
    assert rt.store.create(state)
    started = awaiting[0]
    data = ToolStartData.of(started, machine="fo-web-1", input=copy_input(args, "fo-web-1"))
    status, _ = rt.store.start_call(
        run_id,
        1,
        started.tool_use_id,
        "fo-web-1:1:gone",
        deadline_passed=False,
        start_event=rt.events.frame(run_id, 1, data),
    )
    assert status is Started.FIRST
    rt.store.schedule(advance_member(run_id, 1), now_ms())  # ...and the coordinator died
    result = fan.client.run(run_id).wait(timeout=30)
    assert effects.read_text().split() == ["mark-fo-web-2"]
    (answer,) = tool_results(result).values()
    assert answer["tool_use_id"] == "toolu_fan_cut"
    lines = answer["content"].splitlines()
    assert lines[0] == "execute_command on 2 machines: 1 lost, 1 ok"
    assert 'fo-web-2 (1): ok, exit 0: ""' in lines
    assert any(line.startswith("fo-web-1 (1): lost: ") for line in lines)
    events = list(fan.client.events(run_id, idle_timeout_s=5))
    starts = collections.Counter(e.data["tool_call_id"] for e in events if e.type == "TOOL_START")
    assert starts == collections.Counter(copy_id("toolu_fan_cut", m) for m in machines)


def _marks(effects: Path) -> list[str]:
    return effects.read_text().split()


def test_serial_batches_run_one_after_another(fan: FanFleet, script, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    effects.touch(mode=0o666)
    mark = "$CMDOP_TEST_MACHINE_MARK"
    command = f"echo start-{mark} >> {effects}; sleep 0.3; echo end-{mark} >> {effects}"
    call = use("execute_command", machines="batch=yes", command=command)
    prompt = script([[call], [{"type": "text", "text": "{{results}}"}]])
    done = finish(fan.client, prompt, serial=2)
    assert done.result.status == "done"
    (answer,) = tool_results(done.result).values()
    assert answer["content"].splitlines()[0] == "execute_command on 4 machines: 4 ok"
    # In name order, two at a time: fo-db-1 and fo-db-slow (marked slow), then the webs.
    lines = _marks(effects)
    assert sorted(lines) == sorted(
        f"{edge}-{m}"
        for edge in ("start", "end")
        for m in ("mark-fo-db-1", "slow", "mark-fo-web-1", "mark-fo-web-2")
    )
    first_ends = max(lines.index("end-mark-fo-db-1"), lines.index("end-slow"))
    second_starts = min(lines.index("start-mark-fo-web-1"), lines.index("start-mark-fo-web-2"))
    assert first_ends < second_starts
    assert len(done.of("TOOL_START")) == 4 and len(done.ends) == 4


def test_an_operation_cancel_starts_no_further_batch(fan: FanFleet, script, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    effects.touch(mode=0o666)
    command = f"echo $CMDOP_TEST_MACHINE_MARK >> {effects}; sleep 1"
    call = use("execute_command", machines="batch=yes", command=command)
    prompt = script([[call], [{"type": "text", "text": "not reached"}]])
    cancelled = []

    def on_event(run, event) -> None:
        if event.type == "TOOL_START" and not cancelled:
            cancelled.append(fan.client.cancel(run.run_id))  # an operation cancel

    done = finish(fan.client, prompt, on_event, serial=1)
    assert done.result.status == "cancelled"
    assert _marks(effects) == ["mark-fo-db-1"]
    statuses = {e.data["machine"]: e.data["status"] for e in done.ends}
    assert statuses == {
        "fo-db-1": "ok",
        "fo-db-slow": "cancelled",
        "fo-web-1": "cancelled",
        "fo-web-2": "cancelled",
    }
    assert len(done.of("TOOL_START")) == 4  # each copy answered without starting has one


def test_a_fan_out_in_a_sequential_turn_runs_its_copies_one_by_one(
    fan: FanFleet, script, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    effects.touch(mode=0o666)
    mark = "$CMDOP_TEST_MACHINE_MARK"
    command = f"echo start-{mark} >> {effects}; sleep 0.2; echo end-{mark} >> {effects}"
    call = use("execute_command", machines="env=prod,role=web", command=command)
    prompt = script([[call], [{"type": "text", "text": "{{results}}"}]])
    done = finish(fan.client, prompt, parallel_tools=False)
    assert done.result.status == "done"
    assert _marks(effects) == [
        "start-mark-fo-web-1",
        "end-mark-fo-web-1",
        "start-mark-fo-web-2",
        "end-mark-fo-web-2",
    ]
    (answer,) = tool_results(done.result).values()
    assert answer["content"].splitlines() == [
        "execute_command on 2 machines: 2 ok",
        'fo-web-1, fo-web-2 (2): ok, exit 0: ""',
    ]


def test_a_coordinator_sigkilled_mid_fan_out_runs_no_copy_twice(
    fan: FanFleet, script, tmp_path: Path
) -> None:
    """The coordinator is SIGKILLed (its whole process group) while the first batch
    runs, and a new one started (the module's tests go on with it); the machines hand
    the next batch on through the continuation queue, which the new coordinator takes."""
    effects = tmp_path / "effects"
    effects.touch(mode=0o666)
    command = f"echo $CMDOP_TEST_MACHINE_MARK >> {effects}; sleep 0.5"
    call = use("execute_command", machines="batch=yes", command=command)
    prompt = script([[call], [{"type": "text", "text": "{{results}}"}]])
    killed = []

    def on_event(run, event) -> None:
        if event.type == "TOOL_START" and not killed:
            fan.fleet.workers["coordinator"].kill()
            killed.append(event.data["machine"])
            fan.fleet.start_coordinator()

    done = finish(fan.client, prompt, on_event, serial=2)
    assert killed and done.result.status == "done"
    assert sorted(_marks(effects)) == ["mark-fo-db-1", "mark-fo-web-1", "mark-fo-web-2", "slow"]
    starts = collections.Counter(e.data["tool_call_id"] for e in done.of("TOOL_START"))
    assert len(starts) == 4 and set(starts.values()) == {1}
    assert {e.data["status"] for e in done.ends} == {"ok"} and len(done.ends) == 4
    (answer,) = tool_results(done.result).values()
    assert answer["content"].splitlines()[0] == "execute_command on 4 machines: 4 ok"


def test_an_ask_machine_child_may_fan_out_no_wider_than_its_parent(
    fan: FanFleet, script, tmp_path: Path
) -> None:
    """The parent's max_fanout (2) binds the fan-outs of the runs it starts: the child's
    call on 3 machines is refused as the parent's would be, and runs nowhere."""
    effects = tmp_path / "effects"
    effects.touch(mode=0o666)
    fan_out = use("execute_command", machines="role=web", command=f"echo x >> {effects}")
    child = script([[fan_out], [{"type": "text", "text": "child: {{results}}"}]])
    ask = use("ask_machine", machine="fo-web-1", prompt=child)
    done = finish(
        fan.client, script([[ask], [{"type": "text", "text": "{{results}}"}]]), max_fanout=2
    )
    assert done.result.status == "done", done.result
    (answer,) = tool_results(done.result).values()
    assert "matches 3 machines, more than this run's max_fanout (2)" in answer["content"]
    assert _marks(effects) == []


def test_an_ask_machine_child_fans_out_in_its_parents_serial_batches(
    fan: FanFleet, script, tmp_path: Path
) -> None:
    """The parent's serial (1) binds its child's fan-out: one machine at a time, each
    copy ending before the next starts."""
    effects = tmp_path / "effects"
    effects.touch(mode=0o666)
    mark = "$CMDOP_TEST_MACHINE_MARK"
    command = f"echo start-{mark} >> {effects}; sleep 0.2; echo end-{mark} >> {effects}"
    fan_out = use("execute_command", machines="batch=yes", command=command)
    child = script([[fan_out], [{"type": "text", "text": "child: {{results}}"}]])
    ask = use("ask_machine", machine="fo-web-1", prompt=child)
    done = finish(fan.client, script([[ask], [{"type": "text", "text": "{{results}}"}]]), serial=1)
    assert done.result.status == "done", done.result
    (answer,) = tool_results(done.result).values()
    assert "execute_command on 4 machines: 4 ok" in answer["content"]
    lines = _marks(effects)
    assert len(lines) == 8
    for start, end in zip(lines[::2], lines[1::2], strict=True):
        assert start.startswith("start-") and end == "end-" + start.removeprefix("start-")
