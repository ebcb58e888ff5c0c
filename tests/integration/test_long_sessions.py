"""Long sessions through a fleet of their own: old tool results cleared past the context
threshold, the cache prefix unchanged between clears, the system cached for an hour.

The fleet runs with `CMDOP_CONTEXT_MAX_TOKENS=4000` and `CMDOP_CACHE_TTL=1h`; every
tool call prints 2,400 characters, so a run passes the threshold every few turns. The
fake server refuses a malformed `cache_control` (and a 1h breakpoint after a 5m one),
and reports cache reads by byte-identical prefixes, as the API does.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.core.clearing import CLEARED_TEXT, history_tokens
from cmdop_worker.core.history import is_valid_history
from cmdop_worker.core.request import cache_prefix, request_bytes
from cmdop_worker.models import Message
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import isolated_env, repo_root

pytestmark = pytest.mark.integration

MAX_TOKENS = 4_000
TOOL_TURNS = 12


@pytest.fixture(scope="module")
def long_fleet(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Client]:
    server = RedisServer().start()
    env = isolated_env(
        server.url,
        fake_model,
        context_max_tokens=str(MAX_TOKENS),
        cache_ttl="1h",
        permission_mode="bypass",
        policy_file=str(repo_root() / "tests" / "writable_tmp.toml"),
    )
    fleet = LocalFleet(env, logdir=Path(tmp_path_factory.mktemp("long-logs")))
    try:
        fleet.start_coordinator()
        fleet.start_machine("alpha")
        fleet.wait_ready(["alpha"], timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield client
    finally:
        fleet.stop()
        server.stop()


def long_script(fake: FakeAnthropic) -> str:
    """A script of `TOOL_TURNS` turns each printing 2,400 characters, then an answer."""
    name = f"long{uuid.uuid4().hex[:10]}"
    turn = [
        {"type": "text", "text": "Next log."},
        {
            "type": "tool_use",
            "name": "execute_command",
            "input": {"machine": "alpha", "command": "printf '%02400d' 0"},
        },
    ]
    fake.add_script(name, [turn] * TOOL_TURNS + [[{"type": "text", "text": "read them all"}]])
    return f"[[script:{name}]]"


def bodies_of(fake: FakeAnthropic, marker: str) -> list[dict[str, Any]]:
    return [
        r["body"]
        for r in fake.requests()
        if marker in json.dumps(r["body"].get("messages", [])[:1])
    ]


def responses_of(fake: FakeAnthropic, marker: str) -> list[dict[str, Any]]:
    return [
        r["response"]
        for r in fake.requests()
        if marker in json.dumps(r["body"].get("messages", [])[:1])
    ]


def cleared_count(body: dict[str, Any]) -> int:
    return json.dumps(body["messages"]).count(CLEARED_TEXT)


def test_old_tool_results_are_cleared_in_big_steps_and_the_prefix_holds_between(
    long_fleet: Client, fake_model: FakeAnthropic
) -> None:
    marker = long_script(fake_model)
    result = long_fleet.submit(prompt=f"{marker} read logs", max_turns=20, timeout_s=120).wait(
        timeout=150
    )
    assert result.status == "done" and result.text == "read them all"
    assert is_valid_history(result.messages) == []
    assert history_tokens(result.messages) <= MAX_TOKENS
    bodies = bodies_of(fake_model, marker)
    assert len(bodies) == TOOL_TURNS + 1
    clears = 0
    for previous, current in itertools.pairwise(bodies):
        cleared = cleared_count(current) > cleared_count(previous)
        clears += cleared
        extends = request_bytes(current).startswith(cache_prefix(previous))
        assert extends != cleared, (cleared_count(previous), cleared_count(current))
    assert clears >= 2
    # Between clears, the API would read the previous request's prefix from the cache.
    usages = [r["usage"] for r in responses_of(fake_model, marker)]
    assert sum(u["cache_read_input_tokens"] > 0 for u in usages) >= len(usages) - clears - 1
    for body in bodies:
        messages = [Message.model_validate(m) for m in body["messages"]]
        assert is_valid_history(messages) == []


def test_the_system_prefix_is_cached_for_an_hour_and_messages_for_five_minutes(
    long_fleet: Client, fake_model: FakeAnthropic
) -> None:
    marker = long_script(fake_model)
    long_fleet.submit(prompt=f"{marker} once", max_turns=2, timeout_s=60).wait(timeout=90)
    for body in bodies_of(fake_model, marker):
        system_marks = [b["cache_control"] for b in body["system"] if "cache_control" in b]
        assert system_marks == [{"type": "ephemeral", "ttl": "1h"}]
        message_marks = [
            b["cache_control"]
            for m in body["messages"]
            for b in m["content"]
            if "cache_control" in b
        ]
        assert message_marks and all(mark == {"type": "ephemeral"} for mark in message_marks)
    assert all(r["fault"] is None for r in responses_of(fake_model, marker))


def test_a_thread_continues_from_its_cleared_history(
    long_fleet: Client, fake_model: FakeAnthropic
) -> None:
    marker = long_script(fake_model)
    thread = f"th{uuid.uuid4().hex[:10]}"
    first = long_fleet.submit(
        prompt=f"{marker} read logs", thread_id=thread, max_turns=20, timeout_s=120
    ).wait(timeout=150)
    assert first.status == "done"
    before = len(bodies_of(fake_model, marker))
    second = long_fleet.submit(prompt="and now?", thread_id=thread, timeout_s=60).wait(timeout=90)
    assert second.status == "done"
    follow_up = bodies_of(fake_model, marker)[before]
    sent = [Message.model_validate(m) for m in follow_up["messages"]]
    assert cleared_count(follow_up) > 0 and is_valid_history(sent) == []
    assert history_tokens(sent) <= MAX_TOKENS
