"""Clearing old tool results: when, how much, what stays valid, and the cache prefix."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from cmdop_worker.core.clearing import (
    CLEARED_TEXT,
    DROPPED_TEXT,
    clear_old_results,
    history_tokens,
)
from cmdop_worker.core.context import system_prompt
from cmdop_worker.core.history import is_valid_history, sanitize_history
from cmdop_worker.core.request import build_request, cache_prefix, request_bytes
from cmdop_worker.models import Message, ToolSpec

SHELL = ToolSpec(name="shell", description="Run a command.", input_schema={"type": "object"})
THOUGHT = {"type": "thinking", "thinking": "look at the logs", "signature": "sig"}


def tool_turn(n: int, output_chars: int) -> list[Message]:
    """An assistant call and the user message answering it, with `output_chars` of output."""
    use = {"type": "tool_use", "id": f"toolu_{n}", "name": "shell", "input": {"cmd": f"cat {n}"}}
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": f"toolu_{n}"}
    result["content"] = f"log {n}: " + "x" * output_chars
    if n % 3 == 0:
        result["is_error"] = True
    return [
        Message(role="assistant", content=[THOUGHT, {"type": "text", "text": f"step {n}"}, use]),
        Message(role="user", content=[result]),
    ]


def session(turns: int, output_chars: int = 2_000) -> list[Message]:
    history = [Message(role="user", content="read every log")]
    for n in range(turns):
        history.extend(tool_turn(n, output_chars))
    return history


def results(history: list[Message]) -> list[dict[str, Any]]:
    return [
        b
        for m in history
        if isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    ]


def test_a_history_under_the_threshold_is_left_alone() -> None:
    history = session(5)
    clearing = clear_old_results(history, max_tokens=history_tokens(history))
    assert clearing.cleared == 0 and clearing.history == history


def test_over_the_threshold_the_oldest_results_are_cleared_to_half_of_it() -> None:
    history = session(20)
    before = json.dumps([m.model_dump() for m in history])
    limit = history_tokens(history) - 100
    clearing = clear_old_results(history, max_tokens=limit)
    assert json.dumps([m.model_dump() for m in history]) == before  # input unchanged
    assert clearing.tokens_after == history_tokens(clearing.history) <= limit // 2
    assert clearing.cleared > 1
    cleared = [r["content"] == CLEARED_TEXT for r in results(clearing.history)]
    assert cleared == sorted(cleared, reverse=True)  # oldest first, one run of them
    assert is_valid_history(clearing.history) == []
    assert sanitize_history(clearing.history) == clearing.history
    for old, new in zip(results(history), results(clearing.history), strict=True):
        assert old["tool_use_id"] == new["tool_use_id"]
        assert old.get("is_error") == new.get("is_error")
    assistant = [m for m in history if m.role == "assistant"]
    assert [m for m in clearing.history if m.role == "assistant"] == assistant


def test_clearing_is_idempotent_and_spares_the_newest_results() -> None:
    history = session(4, output_chars=20_000)
    clearing = clear_old_results(history, max_tokens=1_000)
    assert results(clearing.history)[-1] == results(history)[-1]  # the model reads it next
    again = clear_old_results(clearing.history, max_tokens=1_000)
    assert again.cleared == 0 and again.history == clearing.history


def test_a_history_with_nothing_to_clear_is_kept_as_it_is() -> None:
    history = [Message(role="user", content="y" * 40_000)]
    clearing = clear_old_results(history, max_tokens=1_000)
    assert clearing.cleared == 0 and clearing.history == history


def request_for(history: list[Message], turn: int) -> dict[str, Any]:
    return build_request(
        model="m",
        system=system_prompt(agent_prompt="Operate.", platform=None),
        reminder=f"<system-reminder>Turn {turn}.</system-reminder>",
        history=sanitize_history(history),
        tools=[SHELL],
        temperature=None,
        max_tokens=1024,
    )


@pytest.mark.parametrize("output_chars", [800, 3_000])
def test_between_clears_every_request_extends_the_previous_cached_prefix(
    output_chars: int,
) -> None:
    """A long session as the turn task drives it: clear, build, store, add a turn."""
    limit = 6_000
    per_turn = history_tokens(tool_turn(10, output_chars)) + 1
    history = [Message(role="user", content="read every log")]
    previous: dict[str, Any] | None = None
    clear_turns: list[int] = []
    for turn in range(1, 81):
        clearing = clear_old_results(history, max_tokens=limit)
        history = clearing.history
        assert history_tokens(history) <= limit
        assert is_valid_history(history) == []
        request = request_for(history, turn)
        if previous is not None:
            extends = request_bytes(request).startswith(cache_prefix(previous))
            assert extends == (not clearing.changed), turn
        if clearing.changed:
            assert clearing.tokens_after <= limit // 2
            clear_turns.append(turn)
        previous = request
        history = [*history, *tool_turn(turn, output_chars)]
    assert len(clear_turns) >= 2  # the session did pass the threshold, more than once
    # Each clear goes down to half the threshold: the prefix then holds for as many turns
    # as it takes to grow back past the threshold.
    gaps = [b - a for a, b in itertools.pairwise(clear_turns)]
    assert min(gaps) >= (limit // 2) // per_turn, (gaps, per_turn)


def test_when_clearing_results_is_not_enough_the_oldest_exchanges_go() -> None:
    history = session(60, output_chars=10)  # tiny results: the calls themselves are the bulk
    limit = history_tokens(history) // 2
    clearing = clear_old_results(history, max_tokens=limit)
    kept = clearing.history
    assert clearing.dropped > 0 and clearing.tokens_after <= limit // 2
    assert is_valid_history(kept) == []
    assert kept[0].content == [
        {"type": "text", "text": "read every log"},
        {"type": "text", "text": DROPPED_TEXT},
    ]
    assert kept[1].role == "assistant" and kept[-2:] == history[-2:]
    again = clear_old_results(kept, max_tokens=limit)
    assert not again.changed
    more = clear_old_results(kept, max_tokens=limit // 4)
    assert more.history[0] == kept[0]  # the note is there once
