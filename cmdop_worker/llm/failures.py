"""What went wrong with one attempt of a model call, in the words the retry policy reads.

`AnthropicModel` turns each failed attempt into a `Failure` (`status_failure` for an
HTTP status or a stream's `error` event); `kind_name` is how a failure is named in a
`RETRY` event's cause and in the `ModelError` that ends the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import anthropic

from cmdop_worker.core.retry import retry_after_s

FailureKind = Literal[
    "status", "connection", "timeout", "stream_error", "stream_truncated", "malformed"
]


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    status: int | None
    message: str
    retry_after_s: float | None = None


def status_failure(exc: anthropic.APIStatusError) -> Failure:
    status = exc.status_code
    message = _error_message(exc)
    if status == 200:  # an `error` event in the middle of a stream
        return Failure("stream_error", None, message)
    headers = exc.response.headers if exc.response is not None else {}
    return Failure("status", status, message, retry_after_s(dict(headers)))


def _error_message(exc: anthropic.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return f"{error.get('type', 'error')}: {error['message']}"
    return str(exc)


def kind_name(failure: Failure) -> str:
    if failure.kind == "status":
        return f"http_{failure.status}"
    return failure.kind
