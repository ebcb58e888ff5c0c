"""Bad input from every side: requests, the model's output, and tool output.

- Requests that do not validate are refused by the real `cmdop.run` task with a
  message naming the field, and leave no `cmdop:run:<id>:*` key behind (the task taken
  in this process: `turn_harness`); a raw message too deeply nested to decode does not
  take the coordinator worker down.
- Malformed model output (an unknown tool, a duplicated id, arguments that are not an
  object, a call without an id) becomes error tool results; the run goes on.
- Tool output of any size or encoding is capped and stored as valid text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Exchange, Producer

from cmdop_worker.celery_app import create_app
from cmdop_worker.core.history import is_valid_history
from cmdop_worker.models import MAX_PROMPT_CHARS
from cmdop_worker.state.keys import COORDINATOR_QUEUE
from cmdop_worker.testing import fake_script
from tests.harness import TurnHarness

pytestmark = pytest.mark.integration


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


NASTY = {
    "huge prompt": ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
    "deep metadata": ({"prompt": "hi", "metadata": nested(200)}, "metadata"),
    "big metadata": ({"prompt": "hi", "metadata": {"blob": "y" * 100_000}}, "metadata"),
    "max_turns as text": ({"prompt": "hi", "max_turns": "ten"}, "max_turns"),
    "tool_tags as text": ({"prompt": "hi", "tool_tags": "disk"}, "tool_tags"),
    "negative timeout": ({"prompt": "hi", "timeout_s": -5}, "timeout_s"),
    "parallel_tools maybe": ({"prompt": "hi", "parallel_tools": "maybe"}, "parallel_tools"),
    "messages not a list": ({"messages": {"role": "user"}}, "messages"),
    "bad message role": ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    "unknown agent": ({"prompt": "hi", "agent": "root-shell"}, "agent"),
    "unknown field": ({"prompt": "hi", "sudo": True}, "sudo"),
}
BAD_RUN_IDS = ["../../etc/passwd", "a" * 65, "", "run id with spaces", "ünïcode"]


@pytest.fixture
def app(turn_harness: TurnHarness) -> Any:
    """A Celery app of a service of its own, on the in-process coordinator's broker."""
    return create_app(turn_harness.settings)


def refused(app: Any, request: Any, task_id: str, coordinator: TurnHarness) -> str:
    result = app.send_task(
        "cmdop.run", kwargs={"request": request}, queue=COORDINATOR_QUEUE, task_id=task_id
    )
    coordinator.drain()
    with pytest.raises(Exception) as caught:
        result.get(timeout=30)
    return str(caught.value)


def run_keys(client: Any, run_id: str) -> list[str]:
    return list(client.redis.scan_iter(match=f"{client.keys.prefix}run:{run_id}:*", count=1000))


@pytest.mark.parametrize("case", list(NASTY))
def test_a_nasty_request_is_refused_naming_the_field(turn_harness, app, case) -> None:
    client = turn_harness.client
    body, field = NASTY[case]
    run_id = f"nasty-{uuid.uuid4().hex[:10]}"
    task_id = f"task-{uuid.uuid4().hex}"
    message = refused(app, {**body, "run_id": run_id}, task_id, turn_harness)
    assert field in message, message
    assert run_keys(client, run_id) == [] and run_keys(client, task_id) == []


@pytest.mark.parametrize("run_id", BAD_RUN_IDS)
def test_a_bad_run_id_is_refused(turn_harness, app, run_id) -> None:
    client = turn_harness.client
    task_id = f"task-{uuid.uuid4().hex}"
    message = refused(app, {"prompt": "hi", "run_id": run_id}, task_id, turn_harness)
    assert "run_id" in message, message
    assert run_keys(client, task_id) == []
    if run_id:
        assert run_keys(client, run_id.replace("*", "")) == []


def test_requests_that_are_not_objects_are_refused(turn_harness, app) -> None:
    client = turn_harness.client
    for payload in ["just a prompt", 42, None, ["prompt", "hi"]]:
        task_id = f"task-{uuid.uuid4().hex}"
        assert "request" in refused(app, payload, task_id, turn_harness)
        assert run_keys(client, task_id) == []


def test_a_duplicate_run_id_is_refused_while_the_first_still_runs(
    turn_harness, app, script
) -> None:
    client = turn_harness.client
    prompt = script([{"content": [{"type": "text", "text": "first"}], "latency_ms": 1500}])
    run = client.submit(prompt=prompt, run_id=f"dup-{uuid.uuid4().hex[:8]}")
    # The harness takes starts before turns: the second start meets a run still at turn 0.
    message = refused(
        app, {"prompt": "again", "run_id": run.run_id}, uuid.uuid4().hex, turn_harness
    )
    assert "already exists" in message
    assert run.wait(timeout=20).text == "first"


def test_a_message_too_deep_to_decode_does_not_take_the_coordinator_down(
    client, fleet_env, script
) -> None:
    depth = 100_000
    body = '[[], {"request": ' + '{"a": ' * depth + "{}" + "}" * depth + "}, {}]"
    task_id = f"deep-{uuid.uuid4().hex}"
    with Connection(fleet_env["CMDOP_REDIS_URL"]) as conn:
        producer = Producer(conn.channel(), exchange=Exchange(""))
        producer.publish(
            body,
            routing_key=COORDINATOR_QUEUE,
            serializer=None,
            content_type="application/json",
            content_encoding="utf-8",
            headers={
                "lang": "py",
                "task": "cmdop.run",
                "id": task_id,
                "argsrepr": "",
                "kwargsrepr": "",
            },
        )
    # The coordinator goes on serving runs.
    prompt = script([[{"type": "text", "text": "still here"}]])
    assert client.submit(prompt=prompt).wait(timeout=20).text == "still here"
    assert run_keys(client, task_id) == []


# -- malformed model output ----------------------------------------------------------


@pytest.fixture
def mangled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make the in-process fake send what its script format cannot express: a tool call
    whose arguments are a string, and one with no id."""
    original = fake_script.render_blocks

    def render(turn: Any, body: Any, new_id: Any) -> list[dict[str, Any]]:
        blocks = original(turn, body, new_id)
        for block in blocks:
            if block.get("type") != "tool_use":
                continue
            if block["input"].get("mangle") == "string":
                block["input"] = "rm -rf / --no-preserve-root"
            elif block["input"].get("mangle") == "no_id":
                block["id"] = None
                block["input"] = {"machine": "alpha", "command": "echo no-id"}
        return blocks

    monkeypatch.setattr(fake_script, "render_blocks", render)
    yield


def test_malformed_tool_calls_become_error_results(client, script, mangled) -> None:
    prompt = script(
        [
            [
                {"type": "text", "text": "let me try some odd calls"},
                {"type": "tool_use", "name": "no_such_tool", "input": {"x": 1}},
                {"type": "tool_use", "name": "execute_command", "input": {"mangle": "string"}},
                {"type": "tool_use", "name": "execute_command", "input": {"mangle": "no_id"}},
                {
                    "type": "tool_use",
                    "id": "toolu_twice",
                    "name": "execute_command",
                    "input": {"machine": "alpha", "command": "echo first"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_twice",
                    "name": "execute_command",
                    "input": {"machine": "beta", "command": "echo second"},
                },
            ],
            [{"type": "text", "text": "survived: {{results}}"}],
        ]
    )
    # Not streamed: the SDK itself refuses a streamed tool input that is not an object
    # (a "malformed" response, retried like any other); a plain reply passes it through.
    run = client.submit(prompt=prompt, timeout_s=60, stream=False)
    result = run.wait(timeout=30)
    assert result.status == "done"
    assert is_valid_history(result.messages) == []
    calls = [b for b in result.messages[1].content if b["type"] == "tool_use"]
    answers = {b["tool_use_id"]: b for b in result.messages[2].content}
    assert len(calls) == 5 and len(answers) == 5
    by_input = {json.dumps(c["input"], sort_keys=True): answers[c["id"]] for c in calls}
    assert "does not exist" in by_input['{"x": 1}']["content"]
    assert by_input['{"x": 1}']["is_error"]
    errors = [a for a in answers.values() if a.get("is_error")]
    assert len(errors) == 4, answers  # only the first "toolu_twice" ran
    assert any("not run" in a["content"] for a in errors)
    assert answers["toolu_twice"]["content"].strip().endswith("first")


# -- tool output of any size or encoding ---------------------------------------------


def test_tool_output_of_any_size_or_encoding_is_capped_and_stored(client, script, settings) -> None:
    commands = {
        "alpha": "head -c 3000000 /dev/urandom",
        "beta": "printf 'ok \\377\\376\\375 bad utf-8\\n'; yes 'a line of text' | head -c 5000000",
    }
    prompt = script(
        [
            [
                {
                    "type": "tool_use",
                    "name": "execute_command",
                    "input": {"machine": m, "command": c},
                }
                for m, c in commands.items()
            ]
            + [
                {
                    "type": "tool_use",
                    "name": "execute_command",
                    "input": {"machine": "alpha", "command": "head -c 2000000 /dev/urandom >&2"},
                }
            ],
            [{"type": "text", "text": "read it all"}],
        ]
    )
    run = client.submit(prompt=prompt, timeout_s=60)
    events = list(run.events(idle_timeout_s=30))
    result = run.wait(timeout=10)
    assert result.status == "done" and is_valid_history(result.messages) == []

    ends = [e for e in events if e.type == "TOOL_END"]
    assert len(ends) == 3
    for end in ends:
        assert len(end.data["output"]) <= settings.event_output_max_chars + 100
    results = [b for b in result.messages[2].content if b["type"] == "tool_result"]
    for block in results:
        stored = block["content"].encode("utf-8")  # valid text, whatever the tool printed
        assert 1_000 < len(stored) <= settings.tool_output_max_bytes + 1_000
    assert "bad utf-8" in results[1]["content"] and "\ufffd" in results[1]["content"]
    # What went back to the model was the capped output, not megabytes.
    follow_up = script.requests_for(prompt)[1]
    size = len(json.dumps(follow_up["body"], ensure_ascii=False).encode())
    assert size < 3 * settings.tool_output_max_bytes + 80_000
    assert client.redis.strlen(client.keys.result(run.run_id)) < 1_000_000
