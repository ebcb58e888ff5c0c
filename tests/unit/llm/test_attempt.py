"""One attempt at a model call (`llm.attempt.ApiCall`) against the project's fake server.

An attempt's failure is a value the policy reads (`Failure`), not an exception; what
clients saw is shared across attempts, so a later attempt emits only what is new; a
stalled stream turns the call's next attempt into a whole (non-streaming) request.
"""

from __future__ import annotations

import time

import anthropic
import pytest

from cmdop_worker.config import Settings
from cmdop_worker.llm.attempt import ApiCall, Endpoint
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.unit.conftest import answer_with

ANSWER = "one two three four five six seven eight nine ten eleven twelve"


@pytest.fixture(autouse=True)
def _answer(fake: FakeAnthropic) -> None:
    answer_with(fake, ANSWER)


class Attempts:
    """An `ApiCall` to the fake, recording what it emits."""

    def __init__(
        self, fake: FakeAnthropic, *, already_emitted: str = "", **settings: float
    ) -> None:
        config = Settings(anthropic_base_url=fake.url, anthropic_api_key="k", **settings)
        self.client = anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0)
        self.emitted: list[tuple[str, str]] = []
        request = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
        self.call = ApiCall(
            Endpoint(self.client, config, time.sleep, time.monotonic),
            request,
            stream=True,
            emit=lambda kind, text: self.emitted.append((kind, text)),
            watch=None,
            deadline_s=time.monotonic() + 600,
            already_emitted=already_emitted,
        )

    @property
    def tokens(self) -> str:
        return "".join(text for kind, text in self.emitted if kind == "TOKEN")


def test_a_failed_attempt_is_a_value_and_the_next_emits_only_the_rest(fake: FakeAnthropic) -> None:
    fake.inject({"kind": "truncate", "after_events": 6})
    attempts = Attempts(fake)
    failure = attempts.call.attempt()
    assert failure is not None and failure.kind == "stream_truncated"
    seen = attempts.tokens
    assert seen and ANSWER.startswith(seen) and seen != ANSWER
    assert attempts.call.attempt() is None
    assert attempts.call.reply is not None and attempts.call.reply.text == ANSWER
    assert attempts.tokens == ANSWER  # the second attempt's fragments start where clients were


def test_text_clients_saw_before_is_not_sent_again(fake: FakeAnthropic) -> None:
    attempts = Attempts(fake, already_emitted=ANSWER[:20])
    assert attempts.call.attempt() is None
    assert attempts.tokens == ANSWER[20:]


def test_a_stalled_stream_makes_the_next_attempt_a_whole_request(fake: FakeAnthropic) -> None:
    fake.inject({"kind": "stall", "seconds": 2, "after_events": 5})
    attempts = Attempts(fake, stream_idle_timeout_s=0.5)
    failure = attempts.call.attempt()
    assert failure is not None and failure.kind == "timeout"
    assert attempts.call.streaming is False
    assert attempts.call.attempt() is None
    bodies = [r["body"] for r in fake.requests()]
    assert bodies[0].get("stream") is True and "stream" not in bodies[1]
    assert attempts.tokens == ANSWER
