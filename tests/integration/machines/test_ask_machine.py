"""ask_machine and ask_machines: a child run per machine asked, answered in order, an
offline machine or a timeout answered locally, and a cancel reaching the children."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from cmdop_worker.coordinator.local_tools import ASK_TIMEOUT_DEFAULT_MS
from tests.procs import wait_for

from .machine_runs import (
    calls_then_report,
    finish,
    tool_results,
    tool_spec,
    use,
)

pytestmark = pytest.mark.integration


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
        # The tool block names no machine (it is the same in every run): the child's
        # calls go to beta because the run targets it (its reminder says so).
        machine_arg = tool_spec(request, "execute_command")["input_schema"]["properties"]
        assert "default" not in machine_arg["machine"] and "enum" not in machine_arg["machine"]


def test_ask_machine_to_a_machine_never_seen_fails_fast(client, script) -> None:
    child = f"hello {uuid.uuid4().hex}"
    prompt = script(calls_then_report(use("ask_machine", machine="ghost", prompt=child)))
    started = time.monotonic()
    done = finish(client, prompt)
    (end,) = done.ends
    assert end.data["is_error"] and end.data["status"] == "invalid", end.data
    # Never seen by this fleet: unknown, not offline, with the names it might have meant.
    assert end.data["output"].startswith(
        "ghost: local_error: unknown machine 'ghost': no machine of that name has ever joined"
    ), end.data
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
    assert (ghost["host"], ghost["status"]) == ("ghost", "local_error")
    assert ghost["error"].startswith("unknown machine 'ghost': "), ghost
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
