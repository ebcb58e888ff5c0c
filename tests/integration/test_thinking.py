"""Extended thinking through the coordinator and the fake server's signature checks.

The fake signs every thinking block it sends and answers a request that brings one
back altered with the API's 400, so a run that ends `done` after a tool turn proves
its thinking went back byte for byte. The crash test has a fleet of its own, with
short leases, whose coordinator is killed in the middle of a model call.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.errors import RunFailed
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from cmdop_worker.testing.fake_rules import sign_thinking
from tests.harness import TurnHarness

from ..conftest import isolated_env

pytestmark = pytest.mark.integration


@pytest.fixture
def client(turn_harness: TurnHarness) -> Client:
    """A client of a coordinator in this process (`tests.harness`): what thinking changes
    in a request and its replies is the coordinator's alone."""
    return turn_harness.client


ENABLED = {"type": "enabled", "budget_tokens": 2048}
THINK = "The user wants the machine list; list_machines answers that."
TOOL_TURN = [
    {"type": "thinking", "thinking": THINK},
    {"type": "redacted_thinking"},
    {"type": "text", "text": "Let me look."},
    {"type": "tool_use", "name": "list_machines", "input": {}},
]
FINAL = [{"type": "thinking", "thinking": "Both are up."}, {"type": "text", "text": "all up"}]


def with_assistant(requests: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The recorded bodies that carry `count` assistant messages (turn `count + 1`)."""
    return [
        r["body"]
        for r in requests
        if sum(m["role"] == "assistant" for m in r["body"].get("messages", [])) == count
    ]


def test_thinking_is_passed_through_streamed_and_sent_back_byte_exact(client, script) -> None:
    prompt = script([TOOL_TURN, FINAL])
    run = client.submit(prompt=prompt, thinking=ENABLED, timeout_s=60)
    result = run.wait(timeout=60)
    assert result.status == "done" and result.text == "all up"
    requests = script.requests_for(prompt)
    assert len(requests) == 2
    for record in requests:
        body = record["body"]
        assert body["thinking"] == ENABLED
        assert "temperature" not in body and body["tool_choice"] == {"type": "auto"}
        assert record["response"]["fault"] is None
    answered = requests[0]["response"]["content"]
    sent_back = requests[1]["body"]["messages"][1]["content"]
    assert json.dumps(sent_back[:2]) == json.dumps(answered[:2])
    assert sent_back[0]["signature"] == sign_thinking(THINK)
    thinking = [e.data["text"] for e in run.events() if e.type == "THINKING"]
    assert "".join(thinking) == THINK + "Both are up."
    stored = result.messages[1].content
    assert isinstance(stored, list) and json.dumps(stored[:2]) == json.dumps(answered[:2])


def test_without_thinking_the_temperature_is_still_sent(client, script) -> None:
    prompt = script([[{"type": "text", "text": "plain"}]])
    client.submit(prompt=prompt).wait(timeout=30)
    body = script.requests_for(prompt)[0]["body"]
    assert "thinking" not in body and body["temperature"] == 0.3


def test_a_thinking_block_that_does_not_come_back_as_issued_is_refused(client, script) -> None:
    """The fake's check is live: a forged signature is what an altered block looks like."""
    forged = [{**TOOL_TURN[0], "signature": "not-the-fakes"}, *TOOL_TURN[2:]]
    prompt = script([forged, FINAL])
    with pytest.raises(RunFailed) as failed:
        client.submit(prompt=prompt, thinking=ENABLED, timeout_s=60).wait(timeout=60)
    error = failed.value.result.error
    assert error is not None and error.kind == "model_http_400"
    assert "signature" in error.message


# --- a coordinator killed mid-call: the turn runs again from stored history ----------


@pytest.fixture(scope="module")
def crash_fleet(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalFleet, Client]]:
    server = RedisServer().start()
    workdir = tmp_path_factory.mktemp("thinking")
    agents = workdir / "agents.toml"
    agents.write_text(
        '[agents.thinker]\nsystem_prompt = "Think, then act."\n'
        'thinking = { type = "enabled", budget_tokens = 2048 }\n'
    )
    env = isolated_env(server.url, fake_model, lease_s="2", agents_file=str(agents))
    fleet = LocalFleet(env, logdir=Path(workdir))
    try:
        fleet.start_coordinator()
        fleet.wait_ready([], timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield fleet, client
    finally:
        fleet.stop()
        server.stop()


def test_thinking_comes_back_unchanged_after_its_turn_is_rerun(
    crash_fleet: tuple[LocalFleet, Client], fake_model: FakeAnthropic
) -> None:
    """Turn 2's call (1.5 s) loses its coordinator; the restarted one's watchdog runs
    the turn again from the stored history, which must still carry turn 1's thinking
    exactly as the fake signed it (the agent profile turned thinking on)."""
    fleet, client = crash_fleet
    name = f"think{uuid.uuid4().hex[:10]}"
    slow_final = {"content": FINAL, "latency_ms": 1500}
    fake_model.add_script(name, {"turns": [TOOL_TURN, slow_final]})
    marker = f"[[script:{name}]]"
    run = client.submit(prompt=f"{marker} which machines?", agent="thinker", timeout_s=60)

    def mine() -> list[dict[str, Any]]:
        return [
            r for r in fake_model.requests() if marker in json.dumps(r["body"].get("messages", []))
        ]

    give_up = time.monotonic() + 30
    while not with_assistant(mine(), 1):
        assert time.monotonic() < give_up, fleet.logs()
        time.sleep(0.05)
    fleet.workers["coordinator"].kill()
    fleet.start_coordinator()
    result = run.wait(timeout=60)
    assert result.status == "done" and result.text == "all up", fleet.logs()

    records = mine()
    assert with_assistant([records[0]], 0)
    answered = records[0]["response"]["content"]
    assert [b["type"] for b in answered[:2]] == ["thinking", "redacted_thinking"]
    reruns = with_assistant(records, 1)
    assert len(reruns) >= 2  # the killed call and the turn run again
    for body in reruns:
        assert body["thinking"] == ENABLED and "temperature" not in body
        assert json.dumps(body["messages"][1]["content"][:2]) == json.dumps(answered[:2])
    assert all(r["response"]["fault"] is None for r in records)
