"""Child runs of `ask_machine(s)` under their parent's limits, through the session fleet.

A child keeps its parent's platform and mode (so the hide map of
`config/hide_map.example.toml` still applies), its resolved tool tags and parallelism;
it may nest only `CMDOP_MAX_RUN_DEPTH` deep (2 in the session fleet, the default); and
its turn and token limits are a share of what the parent has left.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cmdop_worker.models import RunResult
from cmdop_worker.state.store import RunState
from cmdop_worker.surfaces.client import Client
from tests.procs import wait_for

pytestmark = pytest.mark.integration

# `"browser:plan"` in the session's hide map: only a run with both fields set hides them.
BROWSER_PLAN_HIDDEN = {"execute_command", "write_file", "ask_machines"}


def use(name: str, **tool_input: Any) -> dict[str, Any]:
    return {"type": "tool_use", "name": name, "input": tool_input}


def ask_then_report(tool_use: dict[str, Any], **turn: Any) -> list[object]:
    """Turn 1 makes the call (with `turn`'s options, e.g. latency); turn 2 reports it."""
    first = {"content": [{"type": "text", "text": "asking"}, tool_use], **turn}
    return [first, [{"type": "text", "text": "report: {{results}}"}]]


def tool_names(request: dict[str, Any]) -> set[str]:
    return {t["name"] for t in request["body"].get("tools", [])}


def last_tool_results(request: dict[str, Any]) -> list[str]:
    """The text of each tool_result the model received in `request`'s last message."""
    content = request["body"]["messages"][-1]["content"]
    return [str(b["content"]) for b in content if b.get("type") == "tool_result"]


def children_of(client: Client, run_id: str) -> list[str]:
    return sorted(str(c) for c in client.redis.smembers(client.keys.run(run_id, "children")))


def state_of(client: Client, run_id: str) -> RunState:
    state = client.store.load(run_id)
    assert state is not None, f"no stored state for {run_id}"
    return state


def only_child(client: Client, run_id: str) -> RunState:
    (child_id,) = children_of(client, run_id)
    return state_of(client, child_id)


def started_children(client: Client, run_id: str, count: int) -> list[RunState] | None:
    """The `count` children of `run_id` once each has its state stored, else None."""
    states = [client.store.load(c) for c in children_of(client, run_id)]
    found = [s for s in states if s is not None]
    return found if len(found) == count else None


def run(client: Client, prompt: str, **fields: Any) -> RunResult:
    result = client.submit(prompt=prompt, **fields).wait(timeout=60, raise_on_failure=False)
    assert result.status == "done", result
    return result


def test_a_child_keeps_the_parents_hide_map_tool_tags_and_parallelism(client, script) -> None:
    # The child calls a tool the parent's hide map hides (a coordinator tool: nothing of
    # the machine side is involved): refused, where a child without it would ask.
    grandchild = script([[{"type": "text", "text": "a grandchild answered"}]])
    child = script(
        [
            [use("ask_machines", machines=["alpha"], prompt=grandchild)],
            [{"type": "text", "text": "{{results}}"}],
        ]
    )
    prompt = script(ask_then_report(use("ask_machine", machine="beta", prompt=child)))
    result = run(
        client,
        prompt,
        platform="browser",
        mode="plan",
        tool_tags=["fileread"],
        parallel_tools=False,
    )

    first, second = script.requests_for(child)
    for request in (first, second):
        assert not BROWSER_PLAN_HIDDEN & tool_names(request)
    specs = {t.name: t for m in client.machines() for t in m.tools}
    tagged = {n for n, t in specs.items() if "fileread" in t.tags or t.core} | {"list_machines"}
    assert tool_names(first) == tagged - BROWSER_PLAN_HIDDEN  # the tags restrict turn 1
    assert "ask_machine" in tool_names(second)
    # A call to a hidden tool is refused in the child as it would be in the parent.
    (refused,) = last_tool_results(second)
    assert "ask_machines" in refused and "not available" in refused
    assert "not available" in result.text
    assert script.requests_for(grandchild) == []

    stored = only_child(client, result.run_id)
    assert (stored.request.platform, stored.request.mode) == ("browser", "plan")
    assert stored.tool_tags == ["fileread"]
    assert stored.parallel_tools is False
    assert stored.depth == 1


def test_ask_machine_nests_only_to_the_depth_limit(client, script) -> None:
    great_grandchild = script([[{"type": "text", "text": "too deep to be asked"}]])
    grandchild = script(
        ask_then_report(use("ask_machine", machine="alpha", prompt=great_grandchild))
    )
    child = script(ask_then_report(use("ask_machine", machine="beta", prompt=grandchild)))
    prompt = script(ask_then_report(use("ask_machine", machine="alpha", prompt=child)))
    result = run(client, prompt)

    # The grandchild (depth 2) asked once more: answered at once, no child started.
    _, after_ask = script.requests_for(grandchild)
    (answer,) = last_tool_results(after_ask)
    assert answer.startswith("alpha: local_error: nesting limit reached")
    assert "CMDOP_MAX_RUN_DEPTH=2" in answer
    assert script.requests_for(great_grandchild) == []

    child_state = only_child(client, result.run_id)
    grandchild_state = only_child(client, child_state.run_id)
    assert (child_state.depth, grandchild_state.depth) == (1, 2)
    assert children_of(client, grandchild_state.run_id) == []  # no run at depth 3
    assert "nesting limit reached" in result.text  # reported up the chain


def test_children_share_what_the_parent_has_left_of_turns_and_tokens(client, script) -> None:
    # The children wait a moment on their first turn, so the parent is seen mid-ask.
    child = script([{"content": [{"type": "text", "text": "child done"}], "latency_ms": 1500}])
    prompt = script(ask_then_report(use("ask_machines", machines=["alpha", "beta"], prompt=child)))
    parent = client.submit(prompt=prompt, max_turns=4, token_budget=60_000)
    # A child joins the parent's set just before its state is stored: wait for both.
    children = wait_for(lambda: started_children(client, parent.run_id, 2), 20, "both children")
    asking = state_of(client, parent.run_id)
    assert asking.turn == 1 and asking.awaiting, "the parent moved on before it was read"
    turns_left = asking.max_turns - asking.turn
    tokens_left = asking.token_budget - asking.usage.total_tokens
    assert asking.usage.total_tokens > 0

    for stored in children:
        assert 1 <= stored.max_turns <= turns_left == 3
        assert 1 <= stored.token_budget <= tokens_left // 2
    done = parent.wait(timeout=60, raise_on_failure=False)
    assert done.status == "done"
    answers = json.loads(last_tool_results(script.requests_for(prompt)[1])[0])
    assert [a["status"] for a in answers] == ["response", "response"]
