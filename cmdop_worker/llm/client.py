"""The model seam: one turn's call to the Messages API, with retries and streaming.

`ModelClient` is the Protocol the turn task depends on; `AnthropicModel` implements it
with the anthropic SDK (its own retries off, so ours and its do not multiply). The
policy — what is retried, how long to wait — is the pure `core.retry`; this module
only carries it out and reports every retry through `on_retry`.

Before every attempt the call waits for the fleet's rate limiter (`llm.limiter`): a wait
is reported (cause `rate_limit_wait`), not counted as an attempt. On a 529, or once a
model's attempts are spent, a call with `fallbacks` moves to the next model with fresh
attempts (cause `fallback:<model>`); the reply names the model that answered.

Streaming: the SDK's raw event iterator, folded into the reply by `llm_wire.ReplyStream`
(not the SDK's `MessageStream`, whose accumulator is quadratic in a tool input's size).
Text and thinking deltas go out through `emit` as they arrive, each one through the
turn's `TokenGate`, so a retried or fallen-back call never repeats a token; a
non-streaming call emits its thinking and then its text once, whole.
A stream idle for longer than the idle timeout, or started too close to the deadline,
falls back inline to a non-streaming call for the same turn.

A ui cancel closes the HTTP stream from the cancel hub's thread; the read then fails
and the call raises `StopNow`.

With neither an API key nor a base URL there is nothing a call could reach: it fails at
once (`ModelError` kind `no_credentials`, no request sent) instead of retrying a
connection to the real API with no key, and a coordinator warns of it at start.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import anthropic
import httpx2

from cmdop_worker.config import Settings
from cmdop_worker.core.ratelimit import fallback_switch
from cmdop_worker.core.retry import backoff_delay_s, is_retryable
from cmdop_worker.core.step import ModelReply
from cmdop_worker.core.tokens import TokenGate
from cmdop_worker.errors import LeaseLost, ModelError, StopNow
from cmdop_worker.llm.failures import Failure, kind_name, status_failure
from cmdop_worker.llm.limiter import FleetLimiter, Ticket, Wait, fleet_limiter
from cmdop_worker.llm.traced import TracedModel
from cmdop_worker.llm.wire import ReplyStream, StreamIncomplete, reply_of
from cmdop_worker.runtime import Runtime
from cmdop_worker.state.cancel import CancelWatch

log = logging.getLogger(__name__)

Emit = Callable[[Literal["TOKEN", "THINKING"], str], None]
# Called at every event of a streamed reply, with the block it closed whole (or None)
# and a getter of the reply as far as it is whole; True once it sent a call on (eager
# dispatch): the model call is then committed to this reply.
OnBlock = Callable[[dict[str, Any] | None, Callable[[], ModelReply]], bool]


@dataclass(frozen=True)
class RetryNotice:
    attempt: int
    delay_s: float
    cause: str


class ModelClient(Protocol):
    def complete(
        self,
        request: dict[str, Any],
        *,
        stream: bool,
        emit: Emit,
        watch: CancelWatch | None,
        deadline_s: float,
        on_retry: Callable[[RetryNotice], None],
        already_emitted: str = "",
        fallbacks: Sequence[str] = (),
        on_block: OnBlock | None = None,
    ) -> ModelReply: ...

    def classify(self, request: dict[str, Any], *, timeout_s: float) -> str | None: ...


NO_CREDENTIALS = (
    "neither ANTHROPIC_API_KEY nor ANTHROPIC_BASE_URL is set on the coordinator: set "
    "ANTHROPIC_API_KEY for the Anthropic API, or run `cmdop-worker fake-model` and set "
    "ANTHROPIC_BASE_URL to the URL it prints"
)


def has_model_endpoint(settings: Settings) -> bool:
    """Whether a model call could succeed at all: a key for the API, or another endpoint."""
    key = settings.anthropic_api_key.get_secret_value() if settings.anthropic_api_key else ""
    return bool(key or settings.anthropic_base_url)


def model_client(rt: Runtime) -> ModelClient:
    """This process's model client, built from its settings on first use."""
    return rt.service("model", lambda settings: _traced_model(settings, rt))


def _traced_model(settings: Settings, rt: Runtime) -> ModelClient:
    limiter = fleet_limiter(settings, rt.redis, rt.keys)
    return TracedModel(AnthropicModel(settings, limiter=limiter))


class AnthropicModel:
    def __init__(
        self,
        settings: Settings,
        *,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        limiter: FleetLimiter | None = None,
    ) -> None:
        key = settings.anthropic_api_key.get_secret_value() if settings.anthropic_api_key else None
        self._limiter = limiter
        self._client = anthropic.Anthropic(
            api_key=key or "unset",
            base_url=settings.anthropic_base_url,
            max_retries=0,
            timeout=settings.llm_request_timeout_s,
            # Our `chat` span (llm.traced) is the call's span: the SDK's would be a
            # second one, counting the call's tokens twice.
            open_telemetry=False,
            # Learns every response's rate-limit headers for the fleet, once per attempt.
            middleware=[limiter] if limiter is not None else None,
        )
        self._settings = settings
        self._reachable = has_model_endpoint(settings)
        self._sleep = sleep
        self._monotonic = monotonic
        self._rng = rng or random.Random()

    def close(self) -> None:
        self._client.close()

    def classify(self, request: dict[str, Any], *, timeout_s: float) -> str | None:
        """One cheap, unretried call; None when it fails (the caller then assumes AGENT)."""
        if not self._reachable:
            return None
        try:
            message = self._client.messages.create(**request, timeout=max(timeout_s, 0.001))
        except (anthropic.AnthropicError, httpx2.HTTPError, ValueError) as exc:
            log.warning("intent classifier failed (%s); treating the turn as AGENT", exc)
            return None
        return reply_of(message).text

    def complete(
        self,
        request: dict[str, Any],
        *,
        stream: bool,
        emit: Emit,
        watch: CancelWatch | None,
        deadline_s: float,
        on_retry: Callable[[RetryNotice], None],
        already_emitted: str = "",
        fallbacks: Sequence[str] = (),
        on_block: OnBlock | None = None,
    ) -> ModelReply:
        """`deadline_s` is a monotonic time. Without `stream`, the answer's text is
        emitted once, whole, when the call returns. `already_emitted` is this turn's
        text that clients saw before (a turn re-executed after a crash): not sent again.
        `fallbacks`: the models to try, in order, after the request's own.

        `on_block` sees each event of a streamed reply, with the block it closed whole.
        Once it has sent a call on, the model call is committed to that reply: a
        failure after that is not retried (a new reply would repeat or contradict what
        went out) and the call returns the whole blocks received
        (`ReplyStream.partial_reply`)."""
        if not self._reachable:
            raise ModelError("no_credentials", NO_CREDENTIALS, attempts=0)
        call = _Call(self, request, stream, emit, watch, deadline_s)
        call.on_block = on_block
        call.text.emitted = already_emitted
        chain = [
            str(request.get("model", "")),
            *(m for m in fallbacks if m != request.get("model")),
        ]
        try:
            for index, model in enumerate(chain):
                if index:
                    call.request = {**call.request, "model": model}
                following = chain[index + 1] if index + 1 < len(chain) else None
                reply = self._attempts(call, on_retry, following)
                if reply is not None:
                    return reply if reply.model else replace(reply, model=model)
        except StopNow as stop:
            raise StopNow(call.text.emitted) from stop
        raise AssertionError("unreachable")

    def _attempts(
        self, call: _Call, on_retry: Callable[[RetryNotice], None], following: str | None
    ) -> ModelReply | None:
        """The call on its current model: the reply, or None to go on to `following`."""
        attempts = self._settings.llm_attempts
        for attempt in range(1, attempts + 1):
            ticket = self._admit(call, functools.partial(_waited, on_retry, attempt))
            failure = call.attempt()
            if failure is None:
                assert call.reply is not None
                if self._limiter is not None and ticket is not None:
                    self._limiter.settle(ticket, call.reply.usage)
                return call.reply
            retryable = is_retryable(status=failure.status, kind=failure.kind)
            switch = fallback_switch(
                status=failure.status,
                retryable=retryable,
                attempt=attempt,
                attempts=attempts,
                has_next=following is not None,
            )
            if switch is not None:
                why = f"{switch} on {call.request['model']}: {kind_name(failure)}"
                on_retry(RetryNotice(attempt, 0.0, f"fallback:{following} ({why})"))
                return None
            if not retryable or attempt == attempts:
                raise ModelError(kind_name(failure), failure.message, attempts=attempt)
            delay = backoff_delay_s(
                attempt,
                base_s=self._settings.llm_backoff_base_s,
                max_s=self._settings.llm_backoff_max_s,
                jitter=self._rng.random(),
                retry_after_s=failure.retry_after_s,
            )
            if self._monotonic() + delay >= call.deadline_s:
                raise ModelError("deadline", f"no time left to retry after {failure.message}")
            on_retry(RetryNotice(attempt, delay, f"{kind_name(failure)}: {failure.message}"))
            call.wait(delay)
        raise AssertionError("unreachable")

    def _admit(self, call: _Call, on_wait: Callable[[Wait], None]) -> Ticket | None:
        """Wait for the fleet's limiter: a wait is reported, and is not an attempt."""
        if self._limiter is None:
            return None
        return self._limiter.admit(
            call.request, time_left_s=call._time_left, wait=call.wait, on_wait=on_wait
        )


class _Call:
    """One turn's model call across its attempts."""

    def __init__(
        self,
        model: AnthropicModel,
        request: dict[str, Any],
        stream: bool,
        emit: Emit,
        watch: CancelWatch | None,
        deadline_s: float,
    ) -> None:
        self.model = model
        self.request = request
        self.emit = emit
        self.watch = watch
        self.deadline_s = deadline_s
        self.streaming = stream
        self.text = TokenGate()
        self.thinking = TokenGate()
        self.reply: ModelReply | None = None
        self.on_block: OnBlock | None = None
        self.committed: ReplyStream | None = None  # the stream a block was sent on from

    def wait(self, delay_s: float) -> None:
        if self.watch is not None:
            if self.watch.event.wait(delay_s):
                raise StopNow()
        else:
            self.model._sleep(delay_s)

    def attempt(self) -> Failure | None:
        failure = self._try()
        if failure is not None and self.committed is not None:
            log.warning(
                "model stream failed after its calls went out (%s); the turn goes on "
                "with the blocks it completed",
                failure.message,
            )
            self.reply = self.committed.partial_reply()
            return None
        return failure

    def _try(self) -> Failure | None:
        self._check_cancel()
        try:
            if self.streaming and self._time_left() > self.model._settings.stream_idle_timeout_s:
                self.reply = self._stream()
            else:
                self.reply = self._create()
            return None
        except (anthropic.APITimeoutError, httpx2.TimeoutException) as exc:
            # A stall mid-stream surfaces as httpx2's ReadTimeout, not the SDK's error.
            self._check_cancel()
            if self.streaming:
                # A stalled stream: fall back inline to a non-streaming call.
                log.warning("model stream idle; falling back to a non-streaming call")
                self.streaming = False
            return Failure("timeout", None, str(exc) or "request timed out")
        except anthropic.APIStatusError as exc:
            self._check_cancel()
            return status_failure(exc)
        except (httpx2.RemoteProtocolError, StreamIncomplete) as exc:
            # The stream ended without message_stop: cut mid-body, or a clean end too early.
            self._check_cancel()
            return Failure("stream_truncated", None, str(exc) or "stream truncated")
        except (anthropic.APIConnectionError, httpx2.HTTPError) as exc:
            self._check_cancel()
            return Failure("connection", None, str(exc) or type(exc).__name__)
        except (anthropic.APIResponseValidationError, ValueError) as exc:
            self._check_cancel()
            return Failure("malformed", None, f"malformed response: {exc}")

    def _time_left(self) -> float:
        return self.deadline_s - self.model._monotonic()

    def _check_cancel(self) -> None:
        if self.watch is not None and self.watch.cancelled:
            raise StopNow()
        if self._time_left() <= 0:
            raise ModelError("deadline", "the run's deadline passed during the model call")

    def _timeout(self, read_s: float) -> httpx2.Timeout:
        left = max(self._time_left(), 0.001)
        return httpx2.Timeout(min(read_s, left), connect=min(5.0, left))

    def _create(self) -> ModelReply:
        timeout = self._timeout(self.model._settings.llm_request_timeout_s)
        message = self.model._client.messages.create(**self.request, timeout=timeout)
        reply = reply_of(message)
        # Whole, once the call returns: the thinking first, as a stream would show it.
        if thought := self.thinking.rest_of(_thinking_of(reply)):
            self.emit("THINKING", thought)
        if rest := self.text.rest_of(reply.text):
            self.emit("TOKEN", rest)
        return reply

    def _stream(self) -> ModelReply:
        self.text.new_attempt()
        self.thinking.new_attempt()
        timeout = self._timeout(self.model._settings.stream_idle_timeout_s)
        reply = ReplyStream()
        client = self.model._client
        with client.messages.create(**self.request, stream=True, timeout=timeout) as stream:
            if self.watch is not None:
                self.watch.on_cancel(stream.close)
            for event in stream:
                self._check_cancel()
                streamed = reply.feed(event)
                if streamed is not None:
                    self._forward(*streamed)
                if self.on_block is not None:
                    closed = event.type == "content_block_stop"
                    self._offer(reply, reply.whole_block(event.index) if closed else None)
        return reply.reply()

    def _offer(self, reply: ReplyStream, block: dict[str, Any] | None) -> None:
        """Offer an event (and the block it closed) to `on_block`. Its own failure is
        not the model's (no retry of the reply): it fails the call as it is."""
        assert self.on_block is not None
        try:
            sent = self.on_block(block, reply.partial_reply)
        except (LeaseLost, StopNow):
            raise
        except Exception as exc:
            raise RuntimeError(f"sending a call of the reply failed: {exc!r}") from exc
        if sent:
            self.committed = reply

    def _forward(self, kind: Literal["text", "thinking"], delta: str) -> None:
        if kind == "text":
            if fresh := self.text.feed(delta):
                self.emit("TOKEN", fresh)
        elif fresh := self.thinking.feed(delta):
            self.emit("THINKING", fresh)


def _waited(on_retry: Callable[[RetryNotice], None], attempt: int, wait: Wait) -> None:
    on_retry(RetryNotice(attempt, wait.delay_s, wait.cause))


def _thinking_of(reply: ModelReply) -> str:
    return "".join(str(b.get("thinking", "")) for b in reply.content if b.get("type") == "thinking")
