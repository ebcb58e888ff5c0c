"""Extended thinking: the request's parameters, blocks kept byte for byte, the fake's checks.

The request side is pure (`build_request`, `sanitize_history`); the wire side runs the
real SDK and the model client against the project's fake server, which signs the
thinking it sends and refuses, as the API does, a request that alters it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import pytest

from cmdop_worker.config import AgentProfile, Settings
from cmdop_worker.core.context import system_prompt
from cmdop_worker.core.history import sanitize_history
from cmdop_worker.core.intake import parse_request
from cmdop_worker.core.request import build_request, thinking_on
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.llm.client import AnthropicModel
from cmdop_worker.models import Message, ToolSpec
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from cmdop_worker.testing.fake_rules import request_problem, sign_thinking

SHELL = ToolSpec(name="shell", description="Run a command.", input_schema={"type": "object"})
ENABLED = {"type": "enabled", "budget_tokens": 2048}
THOUGHT = {"type": "thinking", "thinking": 'Disks first, then "memory" — ünïcode.', "signature": ""}
THOUGHT["signature"] = sign_thinking(str(THOUGHT["thinking"]))
TOOL_TURN: list[Any] = [
    {"type": "thinking", "thinking": "Check the disk of alpha first."},
    {"type": "redacted_thinking"},
    {"type": "tool_use", "id": "toolu_1", "name": "shell", "input": {"cmd": "df -h"}},
]


def build(history: list[Message], **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": "m",
        "system": system_prompt(agent_prompt="Operate.", platform=None),
        "reminder": "<system-reminder>Turn 2.</system-reminder>",
        "history": history,
        "tools": [SHELL],
        "temperature": 0.3,
        "max_tokens": 4096,
    }
    return build_request(**{**args, **kw})


def loop_history(first_block: dict[str, Any]) -> list[Message]:
    use = {"type": "tool_use", "id": "toolu_1", "name": "shell", "input": {"cmd": "df"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
    return [
        Message(role="user", content="check the disks"),
        Message(role="assistant", content=[first_block, use]),
        Message(role="user", content=[result]),
    ]


# --- the request ----------------------------------------------------------------------


@pytest.mark.parametrize("thinking", [ENABLED, {"type": "adaptive", "display": "summarized"}])
def test_thinking_is_passed_through_without_temperature_and_with_auto_tool_choice(
    thinking: dict[str, Any],
) -> None:
    request = build(loop_history(THOUGHT), thinking=thinking)
    assert request["thinking"] == thinking
    assert "extra_body" not in request and "temperature" not in json.dumps(request)
    assert request["tool_choice"] == {"type": "auto"}
    assert request_problem(request) is None


def test_without_thinking_or_with_it_disabled_the_temperature_is_sent() -> None:
    assert build(loop_history(THOUGHT))["extra_body"] == {"temperature": 0.3}
    disabled = build(loop_history(THOUGHT), thinking={"type": "disabled"})
    assert disabled["extra_body"] == {"temperature": 0.3}
    assert not thinking_on({"type": "disabled"}) and not thinking_on(None)


def test_a_thinking_budget_past_max_tokens_leaves_room_for_the_answer() -> None:
    big = {"type": "enabled", "budget_tokens": 8000}
    request = build(loop_history(THOUGHT), thinking=big, max_tokens=4096)
    assert request["max_tokens"] == 8000 + 4096
    assert build(loop_history(THOUGHT), thinking=ENABLED)["max_tokens"] == 4096


def test_thinking_blocks_reach_the_request_as_stored_even_when_they_carry_a_marker() -> None:
    marked = {**THOUGHT, "cache_control": {"type": "ephemeral"}}
    redacted = {"type": "redacted_thinking", "data": "opaque.abc"}
    history = loop_history(marked)
    history[1] = Message(role="assistant", content=[marked, redacted, *history[1].content[1:]])
    sent = build(sanitize_history(history), thinking=ENABLED)["messages"][1]["content"]
    assert json.dumps(sent[:2]) == json.dumps([marked, redacted])
    assert json.dumps(sanitize_history(history)[1].content[:2]) == json.dumps([marked, redacted])


def test_a_request_and_an_agent_may_set_thinking_and_bad_forms_are_refused() -> None:
    request = parse_request({"prompt": "hi", "thinking": ENABLED})
    assert (
        request.thinking is not None and request.thinking.model_dump(exclude_none=True) == ENABLED
    )
    assert AgentProfile(name="a", thinking={"type": "adaptive"}).thinking is not None
    for bad in ({"type": "enabled", "budget_tokens": 100}, {"type": "sometimes"}, "on"):
        with pytest.raises(InvalidRequest, match="thinking"):
            parse_request({"prompt": "hi", "thinking": bad})


# --- the fake's rules -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda b: {**b, "thinking": b["thinking"] + " "}, "Invalid `signature`"),
        (lambda b: {**b, "signature": b["signature"][:-1] + "0"}, "Invalid `signature`"),
        (lambda b: {k: v for k, v in b.items() if k != "signature"}, "Invalid `signature`"),
        (lambda b: {**b, "cache_control": {"type": "ephemeral"}}, "Extra inputs"),
    ],
)
def test_the_fake_refuses_an_altered_thinking_block(change: Any, refusal: str) -> None:
    assert request_problem(build(loop_history(THOUGHT))) is None
    problem = request_problem(build(loop_history(change(dict(THOUGHT)))))
    assert problem is not None and refusal in problem


def test_the_fake_refuses_what_the_api_refuses_with_thinking_on() -> None:
    body = build(loop_history(THOUGHT), thinking=ENABLED)
    assert request_problem({**body, "temperature": 0.3}) is not None
    assert request_problem({**body, "tool_choice": {"type": "any"}}) is not None
    assert request_problem({**body, "max_tokens": 2048}) is not None
    text_first = build(loop_history({"type": "text", "text": "hm"}), thinking=ENABLED)
    assert "must start with a thinking block" in str(request_problem(text_first))


# --- on the wire: the SDK, the model client and the fake server -----------------------


@pytest.fixture(autouse=True)
def _think(fake: FakeAnthropic) -> None:
    fake.add_script("think", [TOOL_TURN, [{"type": "text", "text": "fine"}]])


def complete(fake: FakeAnthropic, request: dict[str, Any], *, stream: bool) -> Any:
    model = AnthropicModel(Settings(anthropic_base_url=fake.url, anthropic_api_key="k"))
    emitted: list[tuple[str, str]] = []
    try:
        reply = model.complete(
            request,
            stream=stream,
            emit=lambda kind, text: emitted.append((kind, text)),
            watch=None,
            deadline_s=time.monotonic() + 60,
            on_retry=lambda notice: None,
        )
    finally:
        model.close()
    return reply, emitted


@pytest.mark.parametrize("stream", [True, False])
def test_a_thinking_turn_comes_back_signed_and_is_accepted_unchanged_next_turn(
    fake: FakeAnthropic, stream: bool
) -> None:
    history = [Message(role="user", content="[[script:think]] check alpha")]
    first = build(history, thinking=ENABLED)
    reply, emitted = complete(fake, first, stream=stream)
    assert [b["type"] for b in reply.content] == ["thinking", "redacted_thinking", "tool_use"]
    assert "".join(t for k, t in emitted if k == "THINKING") == TOOL_TURN[0]["thinking"]
    assert reply.content[0]["signature"] == sign_thinking(TOOL_TURN[0]["thinking"])
    # Stored as Redis stores it (JSON), read back, sanitised, sent again.
    stored = Message.model_validate_json(
        Message(role="assistant", content=reply.content).model_dump_json()
    )
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "40% used"}
    history = [*history, stored, Message(role="user", content=[result])]
    second = build(sanitize_history(history), thinking=ENABLED)
    answer, _ = complete(fake, second, stream=stream)
    assert answer.text == "fine"
    sent = fake.requests()[-1]["body"]["messages"][1]["content"]
    assert json.dumps(sent[:2]) == json.dumps(reply.content[:2])


def test_an_altered_thinking_block_gets_the_apis_400(fake: FakeAnthropic) -> None:
    forged = {**THOUGHT, "thinking": THOUGHT["thinking"].upper()}
    body = build(loop_history(forged), thinking=ENABLED)
    body["messages"][0]["content"][0]["text"] = "[[script:think]] again"
    sdk = anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0)
    with sdk, pytest.raises(anthropic.BadRequestError) as refused:
        sdk.messages.create(**body)
    assert refused.value.status_code == 400
    assert "invalid_request_error" in json.dumps(refused.value.body)


def test_the_fake_accepts_a_one_hour_ttl_before_five_minute_ones(fake: FakeAnthropic) -> None:
    body = build(loop_history(THOUGHT), cache_ttl="1h")
    assert [b["cache_control"] for b in body["system"] if "cache_control" in b] == [
        {"type": "ephemeral", "ttl": "1h"}
    ]
    assert request_problem(body) is None
    with anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0) as sdk:
        assert sdk.messages.create(**body).stop_reason == "end_turn"
    late = json.loads(json.dumps(body))
    late["messages"][-1]["content"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    assert "must not come after" in str(request_problem(late))
    odd = json.loads(json.dumps(body))
    odd["system"][0]["cache_control"]["ttl"] = "2h"
    assert "ttl" in str(request_problem(odd))
