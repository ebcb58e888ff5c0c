"""Where a steering message goes in a run's history: always a user turn the API accepts."""

from __future__ import annotations

from cmdop_worker.coordinator.threads import with_user_text
from cmdop_worker.core.history import sanitize_history
from cmdop_worker.models import Message

RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "execute_command", "input": {}}


def test_after_tool_results_the_text_joins_their_message() -> None:
    history = [
        Message(role="user", content="check it"),
        Message(role="assistant", content=[USE]),
        Message(role="user", content=[RESULT]),
    ]
    steered = with_user_text(history, ["and db-1"])
    assert steered[:2] == history[:2]
    assert steered[2].content == [RESULT, {"type": "text", "text": "and db-1"}]
    assert sanitize_history(steered) == steered  # valid as it stands


def test_after_an_answer_the_text_is_a_user_turn_of_its_own() -> None:
    history = [Message(role="user", content="hi"), Message(role="assistant", content="hello")]
    steered = with_user_text(history, ["one", "two"])
    assert steered[:2] == history
    assert steered[2] == Message(
        role="user", content=[{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    )


def test_a_string_prompt_becomes_blocks_with_the_text_after_it() -> None:
    steered = with_user_text([Message(role="user", content="first")], ["second"])
    assert steered == [
        Message(
            role="user",
            content=[{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        )
    ]
