"""The provider's rate limits as data: what a response says, what a call costs, whose
bucket it draws from, and when a model call falls back to another model.

Owns the reading of the `anthropic-ratelimit-{requests,input-tokens,output-tokens}-
{limit,remaining,reset}` headers (an allowance per dimension; `reset` is an RFC 3339
time, turned into "milliseconds from now" with a clock reading the caller passes in),
a call's cost before it is made (one request; input tokens estimated from the request's
size; output tokens as `max_tokens`, which is how the API itself reserves them) and
after (the usage it reported), the limiter scope (a hash of the endpoint and API key,
never the key itself, and the model), the pause a 429 or 529 asks of the whole fleet,
and the fallback decision.

The pace: the API also enforces its per-minute limits over short intervals (60 RPM may
be enforced as 1 request per second, https://platform.claude.com/docs/en/api/rate-limits),
so a bucket that is full must still not be spent in a burst. The fleet hands out
request slots one interval apart (`paced_slot`): 60000 / limit ms, slowed by
`PACE_MARGIN` so that jitter between the grant and the request's arrival does not put
two requests into one interval's share. The interval per unit is read off the headers
as a lower bound (`unit_ms_bound`); the shared pace itself lives in `state.ratelimit`'s
script, which does the same arithmetic. Called by the model seam (`llm.limiter`, `llm.client`); the
shared bucket itself is the Redis script in `state.ratelimit`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from cmdop_worker.models import Usage

Dimension = Literal["requests", "input_tokens", "output_tokens"]
DIMENSIONS: tuple[Dimension, ...] = ("requests", "input_tokens", "output_tokens")
_HEADER_NAMES: Mapping[Dimension, str] = {
    "requests": "requests",
    "input_tokens": "input-tokens",
    "output_tokens": "output-tokens",
}
# Statuses after which the whole fleet holds off the model: the account's limit (429)
# and the provider's overload (529).
PAUSING_STATUS = frozenset({429, 529})
CHARS_PER_TOKEN = 4  # a rough estimate, corrected by the usage the response reports
# Requests go this much slower than the stated limit: a request reaches the provider a
# few milliseconds after its grant, each by a different delay, and the short-interval
# enforcement counts arrivals. 8% of 250 ms (240 RPM) is 20 ms a slot, 80 ms a second:
# the late arrival one request may have before it shares a second with four others.
# (4% met 429s on a loaded host, `python -m bench --only ratelimit`.)
PACE_MARGIN = 0.08


@dataclass(frozen=True)
class Allowance:
    """One dimension of a limit as a response stated it."""

    limit: int
    remaining: int
    reset_in_ms: float | None  # until the bucket is full again; None when not stated


@dataclass(frozen=True)
class Cost:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def of(self, dimension: Dimension) -> int:
        return int(getattr(self, dimension))

    def minus(self, other: Cost) -> Cost:
        return Cost(
            self.requests - other.requests,
            self.input_tokens - other.input_tokens,
            self.output_tokens - other.output_tokens,
        )


def allowances(headers: Mapping[str, str], *, now_unix_s: float) -> dict[Dimension, Allowance]:
    """The allowances a response's headers state, by dimension (absent ones left out)."""
    lowered = {key.lower(): value for key, value in headers.items()}
    found: dict[Dimension, Allowance] = {}
    for dimension, name in _HEADER_NAMES.items():
        prefix = f"anthropic-ratelimit-{name}-"
        limit = _count(lowered.get(prefix + "limit"))
        remaining = _count(lowered.get(prefix + "remaining"))
        if limit is None or remaining is None or limit <= 0:
            continue
        reset_at = unix_time(lowered.get(prefix + "reset"))
        reset_in = None if reset_at is None else max(0.0, (reset_at - now_unix_s) * 1000)
        found[dimension] = Allowance(limit, min(remaining, limit), reset_in)
    return found


def unix_time(text: str | None) -> float | None:
    """An RFC 3339 time (`2026-12-01T10:00:00.250Z`) in Unix seconds; None if it is not one."""
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed.timestamp() if parsed.tzinfo is not None else None


def request_cost(request: Mapping[str, Any]) -> Cost:
    """What a request will draw before it is sent: the API reserves `max_tokens` of
    output; input is estimated from the characters of what is sent."""
    sent = {key: request[key] for key in ("system", "messages", "tools") if key in request}
    chars = len(json.dumps(sent, separators=(",", ":"), ensure_ascii=False, default=str))
    output = request.get("max_tokens")
    return Cost(
        requests=1,
        input_tokens=math.ceil(chars / CHARS_PER_TOKEN),
        output_tokens=output if isinstance(output, int) and output > 0 else 0,
    )


def usage_cost(usage: Usage) -> Cost:
    """What a call drew, as its usage says. Cache reads do not count toward the input
    limit; cache writes do."""
    return Cost(
        requests=1,
        input_tokens=usage.input_tokens + usage.cache_creation_input_tokens,
        output_tokens=usage.output_tokens,
    )


def pace_ms(unit_ms: float) -> float:
    """The spacing between two request slots when one request comes back every `unit_ms`."""
    return unit_ms * (1 + PACE_MARGIN)


def paced_slot(next_ms: float, now_ms: float, unit_ms: float) -> tuple[float, float]:
    """When a request asking at `now_ms` may go, and when the one after it may: never
    before the pace's next slot, nor before it asks; the next slot one spacing later."""
    at_ms = max(next_ms, now_ms)
    return at_ms, at_ms + pace_ms(unit_ms)


def unit_ms_bound(*, limit: int, remaining: int, reset_ms: float) -> float | None:
    """The fewest milliseconds one unit can take to come back, from one response:
    `remaining` is rounded down, so `reset` / (limit - remaining) is never more than the
    true interval. None when the response tells nothing of it (a full bucket)."""
    if remaining >= limit or reset_ms <= 0:
        return None
    return reset_ms / (limit - remaining)


def limiter_scope(*, endpoint: str, api_key: str, model: str) -> str:
    """Whose bucket a call draws from: the account (a hash of the endpoint and key; the
    key itself is never stored) and the model."""
    account = hashlib.sha256(f"{endpoint}\n{api_key}".encode()).hexdigest()[:16]
    return f"{account}:{model}"


def fleet_pause_s(
    status: int | None, *, retry_after_s: float | None, backoff_s: float
) -> float | None:
    """How long every coordinator holds off the model after this status: the server's
    `retry-after` when it gave one, else the backoff the failed caller itself waits."""
    if status not in PAUSING_STATUS:
        return None
    return retry_after_s if retry_after_s is not None else backoff_s


Switch = Literal["overloaded", "attempts_spent"]


def fallback_switch(
    *, status: int | None, retryable: bool, attempt: int, attempts: int, has_next: bool
) -> Switch | None:
    """Whether a failed attempt moves the call to the next model of its fallback list:
    at once when the model is overloaded (529), or once its attempts are spent on
    failures worth retrying. Anything else stays with the model (or fails the call)."""
    if not has_next or not retryable:
        return None
    if status == 529:
        return "overloaded"
    return "attempts_spent" if attempt >= attempts else None


def _count(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        return None
    return value if value >= 0 else None
