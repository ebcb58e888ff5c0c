"""Each behaviour of the agent-loop spec, asserted on the requests the model received.

What needs no machine (the request's fields, structured output, streaming) is taken by a
coordinator in this process (`turn_harness`, `tests.harness`); the rest by the fleet."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from cmdop_worker.core.context import NO_TOOLS_HONESTY
from cmdop_worker.core.request import cache_breakpoint_count, cacheable_share

pytestmark = pytest.mark.integration

TEXT = [{"type": "text", "text": "done"}]


def tool_call(command: str, machine: str = "alpha") -> dict[str, Any]:
    return {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": machine, "command": command},
    }


def tool_names(request: dict[str, Any]) -> list[str]:
    return sorted(t["name"] for t in request["body"].get("tools", []))


def reminder(request: dict[str, Any]) -> str:
    last = request["body"]["messages"][-1]["content"]
    return last[-1]["text"]


def test_tool_tags_restrict_turn_one_only_and_core_tools_stay(client, script) -> None:
    prompt = script(
        [
            [
                {
                    "type": "tool_use",
                    "name": "read_file",
                    "input": {"machine": "alpha", "path": "/etc/hostname"},
                }
            ],
            [tool_call("true")],
            TEXT,
        ]
    )
    client.submit(prompt=prompt, tool_tags=["fileread"]).wait(timeout=30)
    first, second, _ = script.requests_for(prompt)
    specs = {t.name: t for m in client.machines() for t in m.tools}
    expected = [
        *sorted(n for n, t in specs.items() if "fileread" in t.tags or t.core),
        "list_machines",
    ]
    assert tool_names(first) == sorted(expected)
    assert "write_file" not in tool_names(first)
    assert {"write_file", "ask_machine", "ask_machines"} <= set(tool_names(second))


def test_hide_map_hides_tools_and_refuses_a_call_to_one(client, script) -> None:
    prompt = script([[tool_call("echo hi")], TEXT])
    run = client.submit(prompt=prompt, platform="mobile")
    result = run.wait(timeout=30)
    assert result.status == "done"
    for request in script.requests_for(prompt):
        assert "execute_command" not in tool_names(request)
        assert "write_file" not in tool_names(request)
    end = next(e for e in run.events() if e.type == "TOOL_END")
    assert end.data["is_error"] and "execute_command" in end.data["output"]
    assert "not available" in end.data["output"]


def test_system_context_is_fresh_each_turn_and_never_stored(client, script) -> None:
    prompt = script([[tool_call("true")], TEXT])
    result = client.submit(prompt=prompt).wait(timeout=30)
    requests = script.requests_for(prompt)
    for turn, request in enumerate(requests, start=1):
        system = json.dumps(request["body"]["system"])
        assert "You are CMDOP Operator." in system
        assert request["body"]["system"][0]["cache_control"] == {"type": "ephemeral"}
        text = reminder(request)
        assert "<system-reminder>" in text and f"Turn {turn} of" in text
        assert "timezone" in text.lower()  # environment info: no target machine
    assert "system-reminder" not in json.dumps([m.model_dump() for m in result.messages])


def test_target_machine_reminder_replaces_environment_info(client, script) -> None:
    prompt = script(
        [
            [
                {
                    "type": "tool_use",
                    "name": "execute_command",
                    "input": {"command": "echo $CMDOP_TEST_MACHINE_MARK"},
                }
            ],
            TEXT,
        ]
    )
    run = client.submit(prompt=prompt, machine="beta")
    result = run.wait(timeout=30)
    first = script.requests_for(prompt)[0]
    text = reminder(first)
    assert "beta" in text and "timezone" not in text.lower()
    end = next(e for e in run.events() if e.type == "TOOL_END")
    assert end.data["machine"] == "beta" and "mark-beta" in end.data["output"]
    assert result.status == "done"
    execute = next(t for t in first["body"]["tools"] if t["name"] == "execute_command")
    # The tool block names no machine (the same bytes in every run): the reminder does.
    assert "default" not in execute["input_schema"]["properties"]["machine"]
    assert "machine" not in execute["input_schema"].get("required", [])


def test_request_carries_model_temperature_budget_and_auto_tool_choice(
    turn_harness, script
) -> None:
    client = turn_harness.client
    prompt = script([TEXT])
    client.submit(prompt=prompt, model="opus").wait(timeout=30)
    (request,) = script.requests_for(prompt)
    body = request["body"]
    assert body["model"] == "claude-opus-5-5"  # an alias from the configuration
    assert body["temperature"] == 0.3
    assert body["max_tokens"] == 4096
    assert body["tool_choice"] == {"type": "auto"}
    prompt = script([TEXT])
    client.submit(prompt=prompt, model="claude-custom-id").wait(timeout=30)
    assert script.requests_for(prompt)[0]["body"]["model"] == "claude-custom-id"


def test_cache_prefix_is_byte_identical_across_a_ten_turn_run(client, script, capsys) -> None:
    prompt = script([[tool_call(f"echo step {i}")] for i in range(9)] + [TEXT])
    result = client.submit(prompt=prompt, max_turns=10).wait(timeout=60)
    assert result.turns == 10 and result.stop_reason == "end_turn"
    bodies = [r["body"] for r in script.requests_for(prompt)]
    assert len(bodies) == 10
    shares = []
    for prev, cur in itertools.pairwise(bodies):
        assert cache_breakpoint_count(cur) <= 4
        shares.append(cacheable_share(prev, cur))
    assert min(shares[1:]) > 0.8, shares
    usage = result.usage
    read_share = usage.cache_read_input_tokens / (
        usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    )
    assert read_share > 0.5
    with capsys.disabled():
        print(
            f"\n[cache] 10-turn run: prefix share per turn {[round(s, 2) for s in shares]}, "
            f"input tokens read from cache {read_share:.0%}"
        )


def test_run_token_budget_stops_the_run(client, script) -> None:
    prompt = script([[tool_call("true")], TEXT])
    result = client.submit(prompt=prompt, token_budget=1).wait(timeout=30)
    assert result.stop_reason == "budget"
    assert result.turns == 1
    assert len(script.requests_for(prompt)) == 1


def _order(events: list[Any]) -> list[str]:
    return [f"{e.type}:{e.data['machine']}" for e in events if e.type in ("TOOL_START", "TOOL_END")]


def test_sequential_tools_run_in_model_order(client, script) -> None:
    prompt = script([[tool_call("sleep 0.3", "alpha"), tool_call("sleep 0.3", "beta")], TEXT])
    run = client.submit(prompt=prompt, parallel_tools=False)
    run.wait(timeout=30)
    assert _order(list(run.events())) == [
        "TOOL_START:alpha",
        "TOOL_END:alpha",
        "TOOL_START:beta",
        "TOOL_END:beta",
    ]


def test_parallel_tools_overlap_and_results_keep_call_order(client, script) -> None:
    prompt = script(
        [[tool_call("sleep 0.5; echo first", "alpha"), tool_call("echo second", "beta")], TEXT]
    )
    run = client.submit(prompt=prompt)
    run.wait(timeout=30)
    order = _order(list(run.events()))
    assert order.index("TOOL_START:alpha") < order.index("TOOL_END:beta")
    assert order.index("TOOL_END:beta") < order.index("TOOL_END:alpha")  # beta finished first
    follow_up = script.requests_for(prompt)[1]["body"]["messages"][-1]["content"]
    results = [b for b in follow_up if b.get("type") == "tool_result"]
    assert "first" in results[0]["content"] and "second" in results[1]["content"]


def test_agent_profile_sets_prompt_model_and_tool_tags(client, script) -> None:
    prompt = script([TEXT])
    client.submit(prompt=prompt, agent="auditor").wait(timeout=30)
    body = script.requests_for(prompt)[0]["body"]
    assert body["model"] == "claude-haiku-5-5"
    assert "audit machines read-only" in json.dumps(body["system"])
    assert "write_file" not in tool_names({"body": body})


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_structured_output_is_validated(turn_harness, script) -> None:
    client = turn_harness.client
    prompt = script([[{"type": "text", "text": '{"ok": true}'}]])
    run = client.submit(prompt=prompt, output_schema=SCHEMA)
    assert run.wait(timeout=30).output == {"ok": True}
    done = list(run.events())[-1]
    assert done.type == "DONE" and done.data["output"] == {"ok": True}


def test_invalid_output_is_sent_back_once_then_accepted(turn_harness, script) -> None:
    client = turn_harness.client
    prompt = script(
        [[{"type": "text", "text": "it is fine"}], [{"type": "text", "text": '{"ok": false}'}]]
    )
    result = client.submit(prompt=prompt, output_schema=SCHEMA).wait(timeout=30)
    assert result.output == {"ok": False}
    second = script.requests_for(prompt)[1]["body"]["messages"]
    assert "output_schema" in json.dumps(second[-1]) or "schema" in json.dumps(second[-1]).lower()


def test_output_failing_twice_ends_the_run_with_an_error(turn_harness, script) -> None:
    client = turn_harness.client
    from cmdop_worker.errors import RunFailed

    prompt = script([[{"type": "text", "text": "nope"}]])
    with pytest.raises(RunFailed) as failed:
        client.submit(prompt=prompt, output_schema=SCHEMA).wait(timeout=30)
    assert failed.value.result.error.kind == "output_invalid"
    assert len(script.requests_for(prompt)) == 2


def test_tokens_and_thinking_stream_and_add_up_to_the_answer(turn_harness, script) -> None:
    client = turn_harness.client
    answer = "The disks on both machines have plenty of free space left today."
    prompt = script(
        [
            [
                {"type": "thinking", "thinking": "let me think about disks"},
                {"type": "text", "text": answer},
            ]
        ]
    )
    run = client.submit(prompt=prompt)
    result = run.wait(timeout=30)
    events = list(run.events())
    tokens = [e.data["text"] for e in events if e.type == "TOKEN"]
    assert len(tokens) > 1 and "".join(tokens) == answer == result.text
    assert (
        "".join(e.data["text"] for e in events if e.type == "THINKING")
        == "let me think about disks"
    )
    assert script.requests_for(prompt)[0]["body"]["stream"] is True


def test_a_non_streaming_run_emits_the_answer_once(turn_harness, script) -> None:
    client = turn_harness.client
    prompt = script([TEXT])
    run = client.submit(prompt=prompt, stream=False)
    run.wait(timeout=30)
    assert [e.data["text"] for e in run.events() if e.type == "TOKEN"] == ["done"]
    assert "stream" not in script.requests_for(prompt)[0]["body"]


@pytest.fixture(scope="module")
def router_fleet(fleet_env, redis_server, tmp_path_factory):
    """A fleet with the intent router on, in its own Redis database (own queues)."""
    from cmdop_worker.config import Settings
    from cmdop_worker.surfaces.client import Client
    from cmdop_worker.surfaces.fleet import LocalFleet

    url = redis_server.url.rsplit("/", 1)[0] + "/1"
    env = {**fleet_env, "CMDOP_REDIS_URL": url, "CMDOP_INTENT_ROUTER": "on"}
    local = LocalFleet(env, logdir=tmp_path_factory.mktemp("router-logs"))
    try:
        local.start_coordinator()
        local.start_machine("alpha")
        local.wait_ready(["alpha"], timeout_s=60)
        with Client(Settings(redis_url=url)) as client:
            yield client
    finally:
        local.stop()


def _routed(script, answer: str) -> tuple[str, list[dict[str, Any]]]:
    prompt = script([[tool_call("true")], TEXT], model_answers={"claude-haiku-5-5": answer})
    return prompt, []


def test_intent_router_direct_sends_no_tools(router_fleet, script) -> None:
    prompt, _ = _routed(script, "DIRECT")
    router_fleet.submit(prompt=prompt).wait(timeout=30)
    classifier, main = script.requests_for(prompt)[:2]
    assert classifier["body"]["model"] == "claude-haiku-5-5" and "tools" not in classifier["body"]
    assert "tools" not in main["body"] and "tool_choice" not in main["body"]
    assert NO_TOOLS_HONESTY.split(":")[0] in reminder(main)


def test_intent_router_agent_keeps_tools(router_fleet, script) -> None:
    prompt, _ = _routed(script, "AGENT")
    router_fleet.submit(prompt=prompt).wait(timeout=30)
    main = [r for r in script.requests_for(prompt) if r["body"]["model"] != "claude-haiku-5-5"]
    assert "execute_command" in tool_names(main[0])


def test_intent_router_failure_means_agent(router_fleet, script, fake_model) -> None:
    prompt, _ = _routed(script, "DIRECT")
    fake_model.inject({"status": 500})  # the next request is the classifier's
    result = router_fleet.submit(prompt=prompt).wait(timeout=30)
    main = [r for r in script.requests_for(prompt) if r["body"]["model"] != "claude-haiku-5-5"]
    assert "execute_command" in tool_names(main[0])
    assert result.status == "done"


def test_intent_router_is_not_asked_once_history_holds_tool_calls(router_fleet, script) -> None:
    # The API refuses tool blocks in a request without tools: after a tool turn, the
    # router is skipped and the turn keeps its tools, whatever the classifier would say.
    prompt, _ = _routed(script, "DIRECT")
    router_fleet.submit(prompt=prompt).wait(timeout=30)
    requests = script.requests_for(prompt)
    classifier = [r for r in requests if r["body"]["model"] == "claude-haiku-5-5"]
    main = [r for r in requests if r["body"]["model"] != "claude-haiku-5-5"]
    assert len(classifier) == 1 and len(main) == 2
    assert "tools" not in main[0]["body"]
    assert "execute_command" in tool_names(main[1])
