"""The model seam: one turn's call to the Messages API, its attempts and fallbacks.

`ModelClient` is the Protocol the turn task depends on; `AnthropicModel` implements it
with the anthropic SDK (its own retries off, so ours and its do not multiply). The
policy — what is retried, how long to wait — is the pure `core.retry`; this module
only carries it out and reports every retry through `on_retry`.

Before every attempt the call waits for the fleet's rate limiter (`llm.limiter`): a wait
is reported (cause `rate_limit_wait`), not counted as an attempt. On a 529, or once a
model's attempts are spent, a call with `fallbacks` moves to the next model with fresh
attempts (cause `fallback:<model>`); the reply names the model that answered.

One attempt (a streamed or whole request, its text and thinking emitted as they
arrive, a ui cancel closing the stream) is `llm.attempt.ApiCall`'s; this module is
the policy around it.

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
from typing import Any, Protocol

import anthropic
import httpx2

from cmdop_worker.config import Settings
from cmdop_worker.core.ratelimit import fallback_switch
from cmdop_worker.core.retry import backoff_delay_s, is_retryable
from cmdop_worker.core.step import ModelReply
from cmdop_worker.errors import ModelError, StopNow
from cmdop_worker.llm.attempt import ApiCall, Emit, Endpoint, OnBlock
from cmdop_worker.llm.failures import Failure, kind_name
from cmdop_worker.llm.limiter import FleetLimiter, Ticket, Wait, fleet_limiter
from cmdop_worker.llm.traced import TracedModel
from cmdop_worker.llm.wire import reply_of
from cmdop_worker.runtime import Runtime
from cmdop_worker.state.cancel import CancelWatch

log = logging.getLogger(__name__)


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
        self._endpoint = Endpoint(self._client, settings, sleep, monotonic)
        self._reachable = has_model_endpoint(settings)
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
        call = ApiCall(
            self._endpoint,
            request,
            stream=stream,
            emit=emit,
            watch=watch,
            deadline_s=deadline_s,
            on_block=on_block,
            already_emitted=already_emitted,
        )
        try:
            return self._across_models(call, on_retry, fallbacks)
        except StopNow as stop:
            raise StopNow(call.text.emitted) from stop

    def _across_models(
        self, call: ApiCall, on_retry: Callable[[RetryNotice], None], fallbacks: Sequence[str]
    ) -> ModelReply:
        """The reply of the request's model, else of each fallback in turn."""
        asked = call.request.get("model")
        chain = [str(asked or ""), *(m for m in fallbacks if m != asked)]
        for index, model in enumerate(chain):
            if index:
                call.request = {**call.request, "model": model}
            following = chain[index + 1] if index + 1 < len(chain) else None
            reply = self._attempts(call, on_retry, following)
            if reply is not None:
                return reply if reply.model else replace(reply, model=model)
        raise AssertionError("unreachable")

    def _attempts(
        self, call: ApiCall, on_retry: Callable[[RetryNotice], None], following: str | None
    ) -> ModelReply | None:
        """The call on its current model: the reply, or None to go on to `following`."""
        attempts = self._settings.llm_attempts
        for attempt in range(1, attempts + 1):
            ticket = self._admit(call, functools.partial(_waited, on_retry, attempt))
            failure = call.attempt()
            if failure is None:
                return self._settled(call, ticket)
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
            delay = self._backoff_s(call, failure, attempt)
            on_retry(RetryNotice(attempt, delay, f"{kind_name(failure)}: {failure.message}"))
            call.wait(delay)
        raise AssertionError("unreachable")

    def _settled(self, call: ApiCall, ticket: Ticket | None) -> ModelReply:
        """The attempt's reply, its usage told to the fleet's limiter."""
        assert call.reply is not None
        if self._limiter is not None and ticket is not None:
            self._limiter.settle(ticket, call.reply.usage)
        return call.reply

    def _backoff_s(self, call: ApiCall, failure: Failure, attempt: int) -> float:
        """How long to wait before the next attempt; a deadline error when it would
        start too late."""
        delay = backoff_delay_s(
            attempt,
            base_s=self._settings.llm_backoff_base_s,
            max_s=self._settings.llm_backoff_max_s,
            jitter=self._rng.random(),
            retry_after_s=failure.retry_after_s,
        )
        if self._monotonic() + delay >= call.deadline_s:
            raise ModelError("deadline", f"no time left to retry after {failure.message}")
        return delay

    def _admit(self, call: ApiCall, on_wait: Callable[[Wait], None]) -> Ticket | None:
        """Wait for the fleet's limiter: a wait is reported, and is not an attempt."""
        if self._limiter is None:
            return None
        return self._limiter.admit(
            call.request, time_left_s=call.time_left, wait=call.wait, on_wait=on_wait
        )


def _waited(on_retry: Callable[[RetryNotice], None], attempt: int, wait: Wait) -> None:
    on_retry(RetryNotice(attempt, wait.delay_s, wait.cause))
