"""The model client against the project's fake server: retries, backoff, streaming.

A real HTTP server and the real SDK; only the sleep between attempts is recorded
instead of slept, so the spacing of retries is checked exactly and quickly. Where a
test needs a wire the fake's scripts cannot describe (tool input JSON in many small
deltas, or broken), it patches the fake's pure `fake_wire`, never the SDK.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.core.step import ModelReply
from cmdop_worker.errors import ModelError, StopNow
from cmdop_worker.llm.client import AnthropicModel, RetryNotice, has_model_endpoint
from cmdop_worker.models import CancelRequest
from cmdop_worker.state.cancel import CancelWatch
from cmdop_worker.testing import fake_wire
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.unit.conftest import answer_with

ANSWER = "one two three four five six seven eight nine ten eleven twelve"


@pytest.fixture(autouse=True)
def _answers(fake: FakeAnthropic) -> None:
    answer_with(fake, ANSWER)


class Harness:
    def __init__(self, fake: FakeAnthropic, **settings: Any) -> None:
        self.sleeps: list[float] = []
        self.retries: list[RetryNotice] = []
        self.emitted: list[tuple[str, str]] = []
        self.on_emit: Callable[[], None] = lambda: None
        config = Settings(anthropic_base_url=fake.url, anthropic_api_key="k", **settings)
        self.model = AnthropicModel(config, sleep=self.sleeps.append)

    def call(self, *, stream: bool = True) -> str:
        return self.reply(stream=stream).text

    def reply(
        self, *, stream: bool = True, script: str = "answer", watch: CancelWatch | None = None
    ) -> ModelReply:
        content = f"[[script:{script}]] hi"
        request = {
            "model": "m",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": content}],
        }
        try:
            return self.model.complete(
                request,
                stream=stream,
                emit=self._emit,
                watch=watch,
                deadline_s=time.monotonic() + 600,
                on_retry=self.retries.append,
            )
        finally:
            self.model.close()

    def _emit(self, kind: str, text: str) -> None:
        self.emitted.append((kind, text))
        self.on_emit()

    @property
    def tokens(self) -> str:
        return "".join(text for kind, text in self.emitted if kind == "TOKEN")

    @property
    def thinking(self) -> str:
        return "".join(text for kind, text in self.emitted if kind == "THINKING")


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


# --- the streamed reply, accumulated from the raw events ------------------------------

BIG_INPUT = {"path": "/srv/app.py", "content": ("print('héllo \"wörld\"')\t\\ ✓\n" * 2400)[:60_000]}
MIXED = [
    {"type": "thinking", "thinking": 'Which machines? Both, "alpha" and bëta.', "signature": "s1"},
    {"type": "text", "text": "Checking both machines ✓ now.\n"},
    {"type": "tool_use", "id": "toolu_a", "name": "run", "input": {"z": 1, "a": [1.5, 1e-7, None]}},
    {"type": "tool_use", "id": "toolu_b", "name": "noop", "input": {}},
    {"type": "text", "text": "And a file:"},
    {"type": "tool_use", "id": "toolu_c", "name": "write_file", "input": BIG_INPUT},
    {"type": "tool_use", "id": "toolu_d", "name": "run", "input": {"n": 12345678901234567890}},
]


def small_json_chunks(value: Any, piece_chars: int | None = None) -> list[str]:
    """Tool input JSON in 16-character deltas, cutting escapes and words, as the API may."""
    text = json.dumps(value)
    return [text[i : i + 16] for i in range(0, len(text), 16)]


@pytest.fixture
def small_deltas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_wire, "json_chunks", small_json_chunks)


@pytest.mark.usefixtures("small_deltas")
def test_a_large_tool_input_in_thousands_of_deltas_comes_back_exactly(fake: FakeAnthropic) -> None:
    assert len(small_json_chunks(BIG_INPUT)) > 3000
    fake.add_script(
        "big", [[{"type": "tool_use", "id": "toolu_big", "name": "w", "input": BIG_INPUT}]]
    )
    reply = Harness(fake).reply(script="big")
    assert reply.content == [
        {"type": "tool_use", "id": "toolu_big", "name": "w", "input": BIG_INPUT}
    ]
    assert reply.stop_reason == "tool_use"


@pytest.mark.parametrize("deltas", ["as the fake sends them", "small"])
def test_a_streamed_reply_equals_the_non_streamed_one(
    fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch, deltas: str
) -> None:
    if deltas == "small":
        monkeypatch.setattr(fake_wire, "json_chunks", small_json_chunks)
    fake.add_script("mixed", [MIXED])
    streaming = Harness(fake)
    streamed = streaming.reply(script="mixed")
    plain = Harness(fake).reply(script="mixed", stream=False)
    # Byte-identical history: the next turn's prompt-cache prefix depends on it.
    assert json.dumps(streamed.content) == json.dumps(plain.content)
    assert (streamed.stop_reason, streamed.usage) == (plain.stop_reason, plain.usage)
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 1
    assert streaming.tokens == "Checking both machines ✓ now.\nAnd a file:"
    assert streaming.thinking == MIXED[0]["thinking"]


_sse_events = fake_wire.sse_events


def _no_message_stop(message: dict[str, Any], **options: Any) -> list[tuple[str, dict[str, Any]]]:
    return _sse_events(message, **options)[:-1]  # the body then ends cleanly, one event short


def _broken_json_chunks(value: Any, piece_chars: int | None = None) -> list[str]:
    return ['{"path": "a.py", ', '"content": oops}']


def _cut_json_chunks(value: Any, piece_chars: int | None = None) -> list[str]:
    return ['{"path": "a.py", ', '"content": "the first li']  # max_tokens came first


def test_a_tool_input_cut_short_is_read_as_far_as_it_goes(
    fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the SDK's accumulator reads it: the model then sees its call fail and can
    retry it, instead of the whole call being retried into the same cut."""
    monkeypatch.setattr(fake_wire, "json_chunks", _cut_json_chunks)
    fake.add_script(
        "cut", [[{"type": "tool_use", "id": "toolu_cut", "name": "w", "input": {"x": 1}}]]
    )
    harness = Harness(fake, llm_attempts=1)
    reply = harness.reply(script="cut")
    assert reply.content == [
        {"type": "tool_use", "id": "toolu_cut", "name": "w", "input": {"path": "a.py"}}
    ]
    assert harness.retries == []


@pytest.mark.parametrize(
    ("fault", "patch", "kind"),
    [
        ({"kind": "truncate", "after_events": 200}, None, "stream_truncated"),
        (None, ("sse_events", _no_message_stop), "stream_truncated"),
        ({"kind": "error_event", "after_events": 200}, None, "stream_error"),
        (None, ("json_chunks", _broken_json_chunks), "malformed"),
    ],
    ids=["cut mid tool input", "clean end without message_stop", "error event", "bad tool json"],
)
@pytest.mark.usefixtures("small_deltas")
def test_a_broken_stream_is_classified(
    fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch, fault: Any, patch: Any, kind: str
) -> None:
    fake.add_script(
        "big", [[{"type": "tool_use", "id": "toolu_big", "name": "w", "input": BIG_INPUT}]]
    )
    if fault is not None:
        fake.inject(fault)
    if patch is not None:
        monkeypatch.setattr(fake_wire, *patch)
    with pytest.raises(ModelError) as failed:
        Harness(fake, llm_attempts=1).reply(script="big")
    assert failed.value.kind == kind
    assert len(fake.requests()) == 1


@pytest.mark.timeout(60)
def test_a_ui_cancel_closes_the_stream_and_stops(fake: FakeAnthropic) -> None:
    # The stream stalls for longer than the test may run: only closing it ends the read.
    fake.inject({"kind": "stall", "seconds": 300, "after_events": 5})
    hub = SimpleNamespace(clock_ms=lambda: 0)
    watch = CancelWatch(hub, "run", deadline_ms=10**15, read_now=False)  # type: ignore[arg-type]
    harness = Harness(fake, stream_idle_timeout_s=400)

    def cancel_after_two_deltas() -> None:  # the second is the last before the stall
        if len(harness.emitted) == 2:
            cancel = CancelRequest(channel="ui")
            threading.Thread(target=watch.offer, args=(cancel,)).start()

    harness.on_emit = cancel_after_two_deltas
    with pytest.raises(StopNow) as stopped:
        harness.reply(watch=watch)
    assert stopped.value.partial_text == harness.tokens == "one two three four five six "
    assert len(fake.requests()) == 1 and harness.retries == []


@pytest.mark.parametrize(
    ("key", "base_url", "reachable"),
    [
        (None, None, False),
        ("", None, False),
        ("sk-x", None, True),
        (None, "http://127.0.0.1:1", True),
    ],
)
def test_a_model_endpoint_needs_a_key_or_a_base_url(
    key: str | None, base_url: str | None, reachable: bool
) -> None:
    settings = Settings(anthropic_api_key=key, anthropic_base_url=base_url)
    assert has_model_endpoint(settings) is reachable


def test_without_key_or_base_url_a_call_fails_at_once_and_sends_nothing() -> None:
    model = AnthropicModel(Settings(anthropic_api_key=None, anthropic_base_url=None))
    request = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ModelError) as info:
        model.complete(
            request,
            stream=False,
            emit=lambda *_: None,
            watch=None,
            deadline_s=time.monotonic() + 30,
            on_retry=lambda notice: pytest.fail(f"retried: {notice}"),
        )
    assert (info.value.kind, info.value.attempts) == ("no_credentials", 0)
    assert "ANTHROPIC_API_KEY" in info.value.message and "ANTHROPIC_BASE_URL" in info.value.message
    assert "cmdop-worker fake-model" in info.value.message
    assert model.classify(request, timeout_s=1) is None
