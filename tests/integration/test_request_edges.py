"""Request details found in review, through real workers and the fake server.

- A run whose turns land on two coordinators (different `CMDOP_HOSTNAME`s) sends the
  same system blocks byte for byte, so its cache prefix is read, not rewritten.
- A tool call cut off by `max_tokens` is never run with its partial input: the model
  gets an error result saying so and the turn goes on.
- A bad `output_schema` and oversized `messages` are refused when the run is
  submitted, naming the field, before any model call (by a coordinator in this
  process: `turn_harness`).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.core.step import CUT_OFF
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import MAX_PROMPT_CHARS
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet
from tests.integration.test_bad_input import refused, run_keys

pytestmark = pytest.mark.integration

TEXT = {"type": "text", "text": "done: {{results}}"}


def test_turns_on_two_coordinators_send_the_same_system_prefix(
    fleet_env, redis_server, script, tmp_path: Path
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/5"  # own database: own queues
    local = LocalFleet({**fleet_env, "CMDOP_REDIS_URL": url}, logdir=tmp_path)
    release = tmp_path / "release"
    # Turn 1's tool waits until the test has swapped coordinators: turn 2 must be B's.
    wait = f"while [ ! -e {release} ]; do sleep 0.05; done; echo released"
    call = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"command": wait, "timeout_ms": 60_000},
    }
    prompt = script([[call], [TEXT]])
    try:
        local.start_coordinator("coord-a", extra_env={"CMDOP_HOSTNAME": "coord-a"})
        local.start_machine("gate")
        local.wait_ready(["gate"], timeout_s=60)
        with Client(Settings(redis_url=url)) as client:
            run = client.submit(prompt=prompt, machine="gate")
            next(e for e in run.events() if e.type == "TOOL_START")
            local.workers["coord-a"].stop()
            local.start_coordinator("coord-b", extra_env={"CMDOP_HOSTNAME": "coord-b"})
            release.touch()
            result = run.wait(timeout=60)
    finally:
        local.stop()
    assert result.status == "done" and "released" in result.text
    first, second = script.requests_for(prompt)
    assert first["body"]["system"] == second["body"]["system"]  # byte-identical prefix
    assert "coord-a" not in json.dumps(first["body"]) and "coord-b" not in json.dumps(
        second["body"]["system"]
    )
    assert second["response"]["usage"]["cache_read_input_tokens"] > 0


def test_a_call_cut_off_by_max_tokens_is_answered_not_run(client, script) -> None:
    whole = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"command": "echo whole-call"},
    }
    # Streamed cut off after a third of its JSON: read as far as it goes, that is
    # {"command": "echo cut-marker"}, a command that would run.
    cut = {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"command": "echo cut-marker", "note": "x" * 60},
    }
    prompt = script(
        [
            {
                "content": [{"type": "text", "text": "two calls"}, whole, cut],
                "stop_reason": "max_tokens",
            },
            [TEXT],
        ]
    )
    run = client.submit(prompt=prompt, machine="alpha")
    result = run.wait(timeout=60)
    assert result.status == "done" and result.stop_reason == "end_turn"
    ids = [b["id"] for b in result.messages[1].content if b["type"] == "tool_use"]
    ends = {e.data["tool_call_id"]: e.data for e in run.events() if e.type == "TOOL_END"}
    whole_end, cut_end = ends[ids[0]], ends[ids[1]]
    assert (whole_end["status"], cut_end["status"]) == ("ok", "invalid"), ends
    assert "whole-call" in whole_end["output"]
    assert cut_end["output"] == CUT_OFF and "cut-marker" not in json.dumps(ends)
    (cut_start,) = [
        e for e in run.events() if e.type == "TOOL_START" and e.data["tool_call_id"] == ids[1]
    ]
    assert cut_start.data["machine"] is None  # answered by the coordinator, sent nowhere
    # The model was told, and went on.
    _, after = script.requests_for(prompt)
    results = after["body"]["messages"][-1]["content"]
    assert results[1]["is_error"] is True and "max_tokens" in results[1]["content"]


BAD_SCHEMA = {"type": "object", "properties": {"n": {"type": "integr"}}}


def test_a_bad_output_schema_is_refused_at_submit(turn_harness, script) -> None:
    client = turn_harness.client
    prompt = script([[{"type": "text", "text": "{}"}]])
    with pytest.raises(InvalidRequest, match=r"output_schema\.properties\.n\.type"):
        client.submit(prompt=prompt, output_schema=BAD_SCHEMA)
    app = client.celery
    run_id = f"schema-{uuid.uuid4().hex[:10]}"
    body: dict[str, Any] = {"prompt": prompt, "run_id": run_id, "output_schema": BAD_SCHEMA}
    message = refused(app, body, f"task-{uuid.uuid4().hex}", turn_harness)
    assert "output_schema" in message and "not a valid JSON Schema" in message
    assert run_keys(client, run_id) == []
    assert script.requests_for(prompt) == []  # no model call was made


def test_messages_past_the_size_limit_are_refused(turn_harness) -> None:
    client = turn_harness.client
    half = "y" * (MAX_PROMPT_CHARS // 2 + 1)
    messages = [
        {"role": "user", "content": half},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": half},
    ]
    run_id = f"big-{uuid.uuid4().hex[:10]}"
    request = {"messages": messages, "run_id": run_id}
    message = refused(client.celery, request, uuid.uuid4().hex, turn_harness)
    assert "messages" in message and "longer than" in message
    assert run_keys(client, run_id) == []
