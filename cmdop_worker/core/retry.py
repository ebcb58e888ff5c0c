"""Retry policy for LLM calls: what is worth retrying, and how long to wait first.

Owns the retryable statuses and failure kinds, the backoff curve (500 ms doubling up to
32 s, jittered, never below its 500 ms base) and the reading of `retry-after` headers.
Called by the model seam (`llm/client.py`, `llm/failures.py`), which classifies an SDK
error into a `kind` and a status, draws `jitter` from its own random source and
schedules the next attempt; no clock or randomness is read here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

FailureKind = Literal[
    "status", "connection", "timeout", "stream_error", "stream_truncated", "malformed"
]

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
# Client errors that will fail the same way again: retrying only burns the budget.
NEVER_RETRY_STATUS = frozenset({400, 401, 403, 404, 413, 422})
# Anthropic's SDK caps exponents too; 2**64 half-seconds is far past any cap anyway.
_MAX_EXPONENT = 64


def is_retryable(*, status: int | None, kind: FailureKind) -> bool:
    """Whether a failed call may succeed if repeated.

    Transport failures (connection, timeout, a stream that died or was cut short, a
    malformed body) are retried unless they came with a client-error status; a status
    failure is retried for the listed statuses and for any 5xx.
    """
    if status in NEVER_RETRY_STATUS:
        return False
    if kind != "status":
        return True
    return status is not None and (status in RETRYABLE_STATUS or status >= 500)


def backoff_delay_s(
    attempt: int,
    *,
    base_s: float = 0.5,
    max_s: float = 32.0,
    jitter: float,
    retry_after_s: float | None = None,
) -> float:
    """Seconds to wait after failed attempt `attempt` (1-based) before the next one.

    `base_s * 2**(attempt - 1)` capped at `max_s`, scaled into [50%, 100%) by `jitter`
    in [0, 1), and never below `base_s` (nor above `max_s`): `base_s` is the curve's
    floor, so the first wait is `base_s` itself (500 ms by default, as the spec asks)
    and later waits keep their jitter. A server's `retry_after_s` wins when it is
    longer, capped at `2 * max_s` so a confused header cannot park a run.
    """
    if attempt < 1:
        raise ValueError(f"attempt is 1-based, got {attempt}")
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    delay_s = min(base_s * 2.0 ** min(attempt - 1, _MAX_EXPONENT), max_s)
    delay_s = max(delay_s * (0.5 + 0.5 * jitter), min(base_s, max_s))
    if retry_after_s is not None and retry_after_s > delay_s:
        delay_s = min(retry_after_s, 2 * max_s)
    return delay_s


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The server's requested wait in seconds, or None.

    `retry-after-ms` is preferred (Anthropic sends it), then `retry-after` in seconds.
    An HTTP-date `retry-after` gives None: turning it into a delay needs the clock,
    which the caller owns.
    """
    lowered = {key.lower(): value for key, value in headers.items()}
    millis = _non_negative(lowered.get("retry-after-ms"))
    if millis is not None:
        return millis / 1000.0
    return _non_negative(lowered.get("retry-after"))


def _non_negative(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None
