"""A model client whose every call is a `chat <model>` span (see `tracing`).

`model_client` wraps the process's `AnthropicModel` in one. The span covers the whole
call — our retries, their waits and a fallback from streaming — and gets the reply's
usage, finish reason and response model; each retry is an event on it. With tracing
off the wrapper costs a function call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cmdop_worker import tracing
from cmdop_worker.core.step import ModelReply


class TracedModel:
    """Any `llm.client.ModelClient`, traced (it is one itself)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def complete(
        self,
        request: dict[str, Any],
        *,
        on_retry: Callable[[Any], None],
        **options: Any,
    ) -> ModelReply:
        def noted(notice: Any) -> None:  # a `RetryNotice`
            tracing.note_retry(notice.attempt, notice.delay_s, notice.cause)
            on_retry(notice)

        with tracing.model_span(request) as span:
            reply: ModelReply = self.inner.complete(request, on_retry=noted, **options)
            tracing.record_reply(span, reply)
        return reply

    def classify(self, request: dict[str, Any], *, timeout_s: float) -> str | None:
        with tracing.model_span(request):
            answer: str | None = self.inner.classify(request, timeout_s=timeout_s)
        return answer
