"""History sanitation: the rules hold on every output, repairs follow the policy."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmdop_worker.core.history import (
    INTERRUPTED_RESULT_TEXT,
    PLACEHOLDER_USER_TEXT,
    interrupted_result,
    is_valid_history,
    sanitize_history,
)
from cmdop_worker.models import Message


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def use(call_id: str, name: str = "shell") -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": {"cmd": "ls"}}


def result(call_id: str, output: str = "ok") -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": output}


def user(content: str | list[dict[str, Any]]) -> Message:
    return Message(role="user", content=content)


def assistant(content: str | list[dict[str, Any]]) -> Message:
    return Message(role="assistant", content=content)


VALID = [
    user("hi"),
    assistant([text("looking"), use("t1"), use("t2")]),
    user([result("t2"), result("t1"), text("also this")]),
    assistant("done"),
]

REPAIRS = [
    pytest.param(
        [user("hi"), assistant([text("running"), use("t1")])],
        [
            user("hi"),
            assistant([text("running"), use("t1")]),
            user([interrupted_result("t1")]),
        ],
        id="trailing-orphan-call-gets-synthesised-result",
    ),
    pytest.param(
        [user("hi"), assistant([use("t1"), use("t2")]), user([result("t2")])],
        [
            user("hi"),
            assistant([use("t1"), use("t2")]),
            user([result("t2"), interrupted_result("t1")]),
        ],
        id="partial-results-completed",
    ),
    pytest.param(
        [user([result("zz"), text("hi")]), assistant("hello")],
        [user([text("hi")]), assistant("hello")],
        id="result-without-call-dropped",
    ),
    pytest.param(
        [user([result("zz")]), assistant("hello")],
        [user(PLACEHOLDER_USER_TEXT), assistant("hello")],
        id="user-message-of-only-strays-removed-then-placeholder",
    ),
    pytest.param(
        [assistant("I was saying"), user("go on")],
        [user(PLACEHOLDER_USER_TEXT), assistant("I was saying"), user("go on")],
        id="leading-assistant-gets-placeholder",
    ),
    pytest.param(
        [user("a"), user([text("b")]), assistant("c"), assistant("d")],
        [user([text("a"), text("b")]), assistant([text("c"), text("d")])],
        id="same-role-merged",
    ),
    pytest.param(
        [user("a"), assistant(""), assistant([]), user("  "), assistant("x")],
        [user("a"), assistant("x")],
        id="empty-messages-removed",
    ),
    pytest.param(
        [user("a"), assistant([text("x"), text("")])],
        [user("a"), assistant([text("x")])],
        id="blank-text-block-removed",
    ),
    pytest.param(
        [user("a"), assistant([use("t1")]), user([text("note"), result("t1")])],
        [user("a"), assistant([use("t1")]), user([result("t1"), text("note")])],
        id="results-moved-first",
    ),
    pytest.param(
        [
            user("a"),
            assistant([use("t1")]),
            user([result("t1")]),
            assistant([use("t1"), use("t2")]),
            user([result("t1"), result("t2")]),
        ],
        [
            user("a"),
            assistant([use("t1")]),
            user([result("t1")]),
            assistant([use("t2")]),
            user([result("t2")]),
        ],
        id="duplicate-call-id-dropped-with-its-result",
    ),
    pytest.param(
        [user("a"), assistant([use("t1")]), user([result("t1", "1"), result("t1", "2")])],
        [user("a"), assistant([use("t1")]), user([result("t1", "1")])],
        id="duplicate-result-keeps-first",
    ),
    pytest.param(
        [user([use("t1"), text("a")]), assistant([result("t1"), text("b")])],
        [user([text("a")]), assistant([text("b")])],
        id="blocks-in-wrong-role-dropped",
    ),
    pytest.param(
        [user("a"), assistant([text("x"), {"type": "tool_use", "id": "t1"}, {"no": "type"}])],
        [user("a"), assistant([text("x")])],
        id="malformed-blocks-dropped",
    ),
    pytest.param(
        [user("a"), assistant("thinking"), user([result("zz")]), assistant([use("t1")])],
        [
            user("a"),
            assistant([text("thinking"), use("t1")]),
            user([interrupted_result("t1")]),
        ],
        id="stray-only-user-removed-assistants-merge",
    ),
    pytest.param([], [], id="empty-history"),
]


@pytest.mark.parametrize(("history", "expected"), REPAIRS)
def test_repairs(history: list[Message], expected: list[Message]) -> None:
    assert is_valid_history(expected) == []
    assert sanitize_history(history) == expected


def test_valid_history_is_unchanged() -> None:
    assert is_valid_history(VALID) == []
    assert sanitize_history(VALID) == VALID


def test_synthesised_result_shape() -> None:
    assert interrupted_result("t9") == {
        "type": "tool_result",
        "tool_use_id": "t9",
        "is_error": True,
        "content": INTERRUPTED_RESULT_TEXT,
    }


def test_input_not_mutated() -> None:
    history = [user([text("note"), result("t1")]), assistant([use("t1"), use("t1")])]
    before = copy.deepcopy([m.model_dump() for m in history])
    out = sanitize_history(history)
    out[0].content[0]["text"] = "changed"  # type: ignore[index]
    assert [m.model_dump() for m in history] == before


VIOLATIONS = [
    pytest.param([assistant("x")], "first message", id="starts-with-assistant"),
    pytest.param([user("a"), user("b")], "two user messages", id="same-role"),
    pytest.param([user("")], "empty content", id="empty-string"),
    pytest.param([user([])], "empty content", id="empty-list"),
    pytest.param([user("a"), assistant([use("t1")])], "has no tool_result", id="orphan-call"),
    pytest.param([user([result("t1")])], "answers no call", id="orphan-result"),
    pytest.param(
        [user("a"), assistant([use("t1")]), user([text("x"), result("t1")])],
        "after a non-result",
        id="result-not-first",
    ),
    pytest.param(
        [
            user("a"),
            assistant([use("t1")]),
            user([result("t1")]),
            assistant([use("t1")]),
            user([result("t1")]),
        ],
        "duplicate tool_use id",
        id="duplicate-call-id",
    ),
    pytest.param(
        [user("a"), assistant([use("t1")]), user([result("t1"), result("t1")])],
        "more than once",
        id="duplicate-result",
    ),
    pytest.param([user([use("t1")])], "not allowed here", id="tool-use-from-user"),
    pytest.param([user([text(" ")])], "not allowed here", id="blank-text"),
]


@pytest.mark.parametrize(("history", "fragment"), VIOLATIONS)
def test_violations_are_reported(history: list[Message], fragment: str) -> None:
    problems = is_valid_history(history)
    assert any(fragment in p for p in problems), problems


# --- properties --------------------------------------------------------------------

ids = st.sampled_from(["t1", "t2", "t3", ""]) | st.none()
texts = st.sampled_from(["hello", "", "  ", "done"])
blocks = st.one_of(
    texts.map(text),
    st.builds(
        lambda i, name: {"type": "tool_use", "id": i, "name": name, "input": {}},
        ids,
        st.sampled_from(["shell", "read_file"]),
    ),
    st.builds(lambda i, out: {"type": "tool_result", "tool_use_id": i, "content": out}, ids, texts),
    st.just(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
    ),
    st.just({"unexpected": True}),
)
contents = texts | st.lists(blocks, max_size=5)
messages = st.builds(Message, role=st.sampled_from(["user", "assistant"]), content=contents)
histories = st.lists(messages, max_size=10)


@st.composite
def valid_histories(draw: st.DrawFn) -> list[Message]:
    out = [user(draw(st.sampled_from(["hi", "please check the disks"])))]
    counter = 0
    for _ in range(draw(st.integers(0, 4))):
        calls = [f"call_{counter + n}" for n in range(draw(st.integers(0, 3)))]
        counter += len(calls)
        out.append(assistant([text("working"), *map(use, calls)] if calls else "answer"))
        order = draw(st.permutations(calls))
        trailer = [text("and more")] if draw(st.booleans()) else []
        out.append(user([*map(result, order), *trailer] if calls or trailer else "next"))
    return out


@settings(max_examples=300, deadline=None)
@given(histories)
def test_sanitized_history_is_valid_and_stable(history: list[Message]) -> None:
    before = [m.model_dump() for m in history]
    once = sanitize_history(history)
    assert is_valid_history(once) == []
    assert sanitize_history(once) == once
    assert [m.model_dump() for m in history] == before


@settings(max_examples=200, deadline=None)
@given(valid_histories())
def test_valid_histories_pass_through(history: list[Message]) -> None:
    assert is_valid_history(history) == []
    assert sanitize_history(history) == history


@settings(max_examples=200, deadline=None)
@given(histories)
def test_every_surviving_call_keeps_its_id(history: list[Message]) -> None:
    """No tool call that was well-formed and first of its id is lost by the repair."""

    def call_ids(msgs: list[Message]) -> list[str]:
        return [
            b["id"]
            for m in msgs
            if m.role == "assistant" and isinstance(m.content, list)
            for b in m.content
            if b.get("type") == "tool_use"
            and isinstance(b.get("id"), str)
            and b["id"]
            and isinstance(b.get("name"), str)
        ]

    assert call_ids(sanitize_history(history)) == list(dict.fromkeys(call_ids(history)))
