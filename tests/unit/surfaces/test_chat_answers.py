"""A line typed in `chat` answers a waiting call only as a command; anything else,
a yes-or-no answer to the model included, is a message."""

from __future__ import annotations

import pytest

from cmdop_worker.surfaces.chat_answers import Answer, Refused, chat_answer

ONE = ["toolu_01AAA"]
TWO = ["toolu_01AAA", "toolu_02BBB"]


@pytest.mark.parametrize(
    "line",
    [
        "y",
        "yes",
        "Y",
        "n",
        "no",
        "yes please keep a copy",
        "n not on this box",
        "ok",
        "approve",
        "approve it",
        '{"command": "touch /tmp/x"}',
        "/etc/passwd, what is in it?",
        "/approved",
        "please /approve",
        " approve /approve",
    ],
)
def test_a_line_that_is_not_a_command_is_a_message(line: str) -> None:
    assert chat_answer(line, ONE) is None
    assert chat_answer(line, TWO) is None
    assert chat_answer(line, []) is None


@pytest.mark.parametrize(
    ("line", "answer"),
    [
        ("/approve", Answer("toolu_01AAA", approve=True)),
        ("  /APPROVE  ", Answer("toolu_01AAA", approve=True)),
        ("/approve toolu_01AAA", Answer("toolu_01AAA", approve=True)),
        ("/deny", Answer("toolu_01AAA", approve=False)),
        ("/deny not on this box", Answer("toolu_01AAA", approve=False, reason="not on this box")),
        ("/deny toolu_01AAA too risky", Answer("toolu_01AAA", approve=False, reason="too risky")),
        # Only the whole id names the call: a word that starts like it is the reason.
        (
            "/deny toolu_01 is wrong",
            Answer("toolu_01AAA", approve=False, reason="toolu_01 is wrong"),
        ),
        ('/edit {"command": "ls"}', Answer("toolu_01AAA", approve=True, input={"command": "ls"})),
        (
            '/edit toolu_01AAA {"command": "ls"}',
            Answer("toolu_01AAA", approve=True, input={"command": "ls"}),
        ),
    ],
)
def test_commands_answer_the_one_waiting_call(line: str, answer: Answer) -> None:
    assert chat_answer(line, ONE) == answer


@pytest.mark.parametrize(
    ("line", "answer"),
    [
        ("/approve toolu_02BBB", Answer("toolu_02BBB", approve=True)),
        ("/approve toolu_02", Answer("toolu_02BBB", approve=True)),  # a prefix naming one
        ("/deny toolu_01AAA rm is too much", Answer("toolu_01AAA", False, reason="rm is too much")),
        ('/edit toolu_02 {"command": "ls"}', Answer("toolu_02BBB", True, input={"command": "ls"})),
    ],
)
def test_with_several_waiting_the_command_names_its_call(line: str, answer: Answer) -> None:
    assert chat_answer(line, TWO) == answer


@pytest.mark.parametrize(
    ("line", "waiting", "says"),
    [
        ("/approve", [], "no call waits for approval"),
        ("/deny because", [], "no call waits for approval"),
        (
            "/approve",
            TWO,
            "2 calls wait for approval; name one by its id: toolu_01AAA, toolu_02BBB",
        ),
        ("/approve toolu_0", TWO, "2 calls wait"),  # a prefix of both names neither
        ("/deny too risky", TWO, "2 calls wait"),
        ("/approve please", ONE, "/approve takes only a call id"),
        ("/edit", ONE, "/edit needs the new input as a JSON object"),
        ("/edit ls -la", ONE, "/edit needs the new input as a JSON object"),
        ("/edit [1, 2]", ONE, "/edit needs the new input as a JSON object"),
    ],
)
def test_a_command_that_answers_nothing_says_why(line: str, waiting: list[str], says: str) -> None:
    refused = chat_answer(line, waiting)
    assert isinstance(refused, Refused) and says in refused.message
