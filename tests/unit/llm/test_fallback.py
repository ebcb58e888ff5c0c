"""Model fallback in the model client, against the project's fake server and the real SDK.

On a 529 the call moves to the next model at once; after the model's attempts are spent
on failures worth retrying, too; the notice names the switch and the reply the model
that answered. Sleeps between attempts are recorded, not slept.
"""

from __future__ import annotations

import time

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.core.step import ModelReply
from cmdop_worker.errors import ModelError
from cmdop_worker.llm.client import AnthropicModel, RetryNotice
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.unit.conftest import answer_with

ANSWER = "the disks are fine"


@pytest.fixture(autouse=True)
def _answers(fake: FakeAnthropic) -> None:
    answer_with(fake, ANSWER)


def call(
    fake: FakeAnthropic, fallbacks: tuple[str, ...], *, stream: bool = True, attempts: int = 3
) -> tuple[ModelReply, list[RetryNotice], list[str]]:
    settings = Settings(anthropic_base_url=fake.url, anthropic_api_key="k", llm_attempts=attempts)
    sleeps: list[float] = []
    notices: list[RetryNotice] = []
    tokens: list[str] = []
    model = AnthropicModel(settings, sleep=sleeps.append)
    request = {
        "model": "primary",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
    }
    try:
        reply = model.complete(
            request,
            stream=stream,
            emit=lambda kind, text: tokens.append(text),
            watch=None,
            deadline_s=time.monotonic() + 60,
            on_retry=notices.append,
            fallbacks=fallbacks,
        )
    finally:
        model.close()
    assert "".join(tokens) == ANSWER  # said once, whichever model said it
    return reply, notices, [rec["body"]["model"] for rec in fake.requests()]


@pytest.mark.parametrize("stream", [True, False])
def test_an_overloaded_model_falls_back_at_once(fake: FakeAnthropic, stream: bool) -> None:
    fake.inject({"status": 529})
    reply, notices, models = call(fake, ("second", "third"), stream=stream)
    assert reply.model == "second" and reply.text == ANSWER
    assert models == ["primary", "second"]
    assert [n.cause for n in notices] == ["fallback:second (overloaded on primary: http_529)"]


def test_a_model_whose_attempts_are_spent_hands_the_call_on(fake: FakeAnthropic) -> None:
    fake.inject({"status": 500, "times": 3}, {"status": 529})
    reply, notices, models = call(fake, ("second", "third"))
    assert models == ["primary"] * 3 + ["second", "third"]
    assert reply.model == "third"
    causes = [n.cause for n in notices]
    assert causes[:2] == ["http_500: api_error: Fake api_error"] * 2
    assert causes[2] == "fallback:second (attempts_spent on primary: http_500)"
    assert causes[3] == "fallback:third (overloaded on second: http_529)"


def test_without_fallbacks_a_529_is_retried_on_the_same_model(fake: FakeAnthropic) -> None:
    fake.inject({"status": 529})
    reply, notices, models = call(fake, ())
    assert models == ["primary", "primary"] and reply.model == "primary"
    assert notices[0].cause.startswith("http_529")


def test_a_request_the_api_refuses_does_not_fall_back(fake: FakeAnthropic) -> None:
    fake.inject({"status": 400})
    with pytest.raises(ModelError) as failed:
        call(fake, ("second",))
    assert failed.value.kind == "http_400"
    assert [rec["body"]["model"] for rec in fake.requests()] == ["primary"]


def test_the_last_model_fails_the_call_once_its_attempts_are_spent(fake: FakeAnthropic) -> None:
    fake.inject({"status": 503, "times": 4})
    with pytest.raises(ModelError) as failed:
        call(fake, ("second",), attempts=2)
    assert failed.value.kind == "http_503" and failed.value.attempts == 2
    assert [rec["body"]["model"] for rec in fake.requests()] == ["primary"] * 2 + ["second"] * 2
