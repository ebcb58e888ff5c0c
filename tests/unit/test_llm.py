"""The model client against the project's fake server: retries, backoff, streaming.

A real HTTP server and the real SDK; only the sleep between attempts is recorded
instead of slept, so the spacing of retries is checked exactly and quickly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.errors import ModelError
from cmdop_worker.llm import AnthropicModel, RetryNotice
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

ANSWER = "one two three four five six seven eight nine ten eleven twelve"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        server.add_script("answer", [[{"type": "text", "text": ANSWER}]])
        server.set_default("answer")
        yield server


@pytest.fixture(autouse=True)
def _reset(fake: FakeAnthropic) -> None:
    fake.reset()


class Harness:
    def __init__(self, fake: FakeAnthropic, **settings: Any) -> None:
        self.sleeps: list[float] = []
        self.retries: list[RetryNotice] = []
        self.emitted: list[tuple[str, str]] = []
        config = Settings(anthropic_base_url=fake.url, anthropic_api_key="k", **settings)
        self.model = AnthropicModel(config, sleep=self.sleeps.append)

    def call(self, *, stream: bool = True) -> str:
        request = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
        try:
            reply = self.model.complete(
                request,
                stream=stream,
                emit=lambda kind, text: self.emitted.append((kind, text)),
                watch=None,
                deadline_s=time.monotonic() + 60,
                on_retry=self.retries.append,
            )
        finally:
            self.model.close()
        return reply.text

    @property
    def tokens(self) -> str:
        return "".join(text for kind, text in self.emitted if kind == "TOKEN")


def test_retries_back_off_exponentially_within_bounds(fake: FakeAnthropic) -> None:
    fake.inject({"status": 529, "times": 4})
    harness = Harness(fake)
    assert harness.call() == ANSWER
    assert len(fake.requests()) == 5
    assert len(harness.sleeps) == 4
    for attempt, delay in enumerate(harness.sleeps, start=1):
        full = min(0.5 * 2 ** (attempt - 1), 32.0)
        assert full / 2 <= delay <= full, (attempt, delay)
    assert [n.attempt for n in harness.retries] == [1, 2, 3, 4]
    assert all("529" in n.cause for n in harness.retries)


def test_retry_after_is_honoured(fake: FakeAnthropic) -> None:
    fake.inject({"status": 429, "retry_after_s": 3})
    harness = Harness(fake)
    assert harness.call() == ANSWER
    assert harness.sleeps == [3.0]


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_client_errors_are_never_retried(fake: FakeAnthropic, status: int) -> None:
    fake.inject({"status": status, "times": 6})
    harness = Harness(fake)
    with pytest.raises(ModelError) as failed:
        harness.call()
    assert failed.value.kind == f"http_{status}"
    assert len(fake.requests()) == 1 and harness.sleeps == []


def test_six_attempts_then_a_named_error(fake: FakeAnthropic) -> None:
    fake.inject({"status": 500, "times": 10})
    harness = Harness(fake)
    with pytest.raises(ModelError) as failed:
        harness.call()
    assert failed.value.kind == "http_500" and failed.value.attempts == 6
    assert len(fake.requests()) == 6 and len(harness.sleeps) == 5


def test_the_sdk_does_not_retry_on_its_own(fake: FakeAnthropic) -> None:
    fake.inject({"status": 503, "times": 2})
    harness = Harness(fake, llm_attempts=1)
    with pytest.raises(ModelError):
        harness.call()
    assert len(fake.requests()) == 1


@pytest.mark.parametrize(
    "fault", [{"kind": "error_event", "after_events": 6}, {"kind": "truncate", "after_events": 6}]
)
def test_a_stream_that_dies_is_retried_without_repeating_tokens(fake: FakeAnthropic, fault) -> None:
    fake.inject(fault)
    harness = Harness(fake)
    assert harness.call() == ANSWER
    assert len(fake.requests()) == 2
    assert harness.tokens == ANSWER  # fragments seen before the failure are not sent again
    assert len(harness.retries) == 1


def test_a_stalled_stream_falls_back_to_a_non_streaming_call(fake: FakeAnthropic) -> None:
    fake.inject({"kind": "stall", "seconds": 2, "after_events": 5})
    harness = Harness(fake, stream_idle_timeout_s=0.5)
    assert harness.call() == ANSWER
    bodies = [r["body"] for r in fake.requests()]
    assert bodies[0].get("stream") is True and "stream" not in bodies[1]
    assert harness.tokens == ANSWER
    assert "timeout" in harness.retries[0].cause


def test_a_malformed_body_is_retried(fake: FakeAnthropic) -> None:
    fake.inject({"kind": "malformed"})
    harness = Harness(fake)
    assert harness.call(stream=False) == ANSWER
    assert "malformed" in harness.retries[0].cause


def test_a_connection_reset_is_retried(fake: FakeAnthropic) -> None:
    fake.inject({"kind": "reset"})
    harness = Harness(fake)
    assert harness.call(stream=False) == ANSWER
    assert harness.retries[0].cause.startswith("connection")
