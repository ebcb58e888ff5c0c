"""Pure rate limiting of the fake Anthropic server: buckets, verdicts, headers.

Like the API, the fake keeps a token bucket per model for each of requests, input
tokens and output tokens: capacity `limit`, refilled evenly so that it is full again
`window_s` after it was empty (the API's window is a minute; a test may make it a
second, so "5 requests/s" is `requests=5, window_s=1`). A request is refused with a 429
(`rate_limit_error`, `retry-after` in whole seconds, as the API sends it) when it finds
fewer than one request, fewer than its input tokens, or no output tokens left; output
tokens are taken once the answer is known and may leave the bucket in debt. Every
answer carries the `anthropic-ratelimit-{requests,input-tokens,output-tokens}-
{limit,remaining,reset}` headers (`reset`: RFC 3339, to the millisecond, when that
bucket is full again).

With `short_interval_s` set, each bucket is also enforced over that shorter interval,
as the API documents it ("you may hit rate limits over shorter time intervals: 60 RPM
may be enforced as 1 request per second; short bursts of requests at a high volume can
surpass the rate limit", https://platform.claude.com/docs/en/api/rate-limits, section
"About our limits"; the same page: "capacity is continuously replenished up to your
maximum limit, rather than being reset at fixed intervals"). The fake models it at its
strictest: what was taken in any `short_interval_s` may not exceed that interval's share
of the limit (240 RPM over 1 s: at most 4 requests in any second; similarly input
tokens, and output tokens taken in the interval must have left some). Beyond it the
answer is a 429 with `retry-after` (whole seconds, at least 1: when enough of the
interval's takings have aged out). The headers still state only the per-minute buckets,
as the API's do: a client learns the short interval from nowhere but the docs.

The default limits are high enough that nothing the tests or benchmarks do reaches
them unless they set lower ones (`PUT /_fake/rate_limit`). Input tokens are counted
as the request's characters / 4, cache reads included. No clock here: the shell
(`fake_state`) passes the time in.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Dimension = Literal["requests", "input_tokens", "output_tokens"]
DIMENSIONS: tuple[Dimension, ...] = ("requests", "input_tokens", "output_tokens")
_HEADER = {"requests": "requests", "input_tokens": "input-tokens", "output_tokens": "output-tokens"}


class RateLimit(BaseModel):
    """The fake's limits, per model: each bucket's capacity and how long it takes to refill."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests: int = Field(default=100_000, ge=1)
    input_tokens: int = Field(default=100_000_000, ge=1)
    output_tokens: int = Field(default=20_000_000, ge=1)
    window_s: float = Field(default=60.0, gt=0)
    # Also enforce each bucket over this many seconds (its share of the limit); None: not.
    short_interval_s: float | None = Field(default=None, gt=0)

    def capacity(self, dimension: Dimension) -> int:
        return int(getattr(self, dimension))

    def short_capacity(self, dimension: Dimension) -> float | None:
        """What may be taken in any `short_interval_s` (None: no short interval)."""
        if self.short_interval_s is None:
            return None
        return self.capacity(dimension) * min(self.short_interval_s / self.window_s, 1.0)

    def rate_per_s(self, dimension: Dimension) -> float:
        return self.capacity(dimension) / self.window_s


@dataclass
class _Bucket:
    level: float
    at_s: float


@dataclass(frozen=True)
class Refusal:
    """A request the limits turn away: a 429 with this `retry-after`."""

    dimension: Dimension
    retry_after_s: int

    @property
    def message(self) -> str:
        return f"fake: rate limit of {self.dimension.replace('_', ' ')} exceeded"


@dataclass
class Buckets:
    """Every model's buckets under one `RateLimit`; not thread-safe (the shell locks)."""

    limit: RateLimit = field(default_factory=RateLimit)
    _models: dict[tuple[str, Dimension], _Bucket] = field(default_factory=dict)
    # What was taken within the short interval, oldest first: (at_s, amount).
    _recent: dict[tuple[str, Dimension], deque[tuple[float, float]]] = field(default_factory=dict)

    def reset(self, limit: RateLimit | None = None) -> None:
        self.limit = limit or RateLimit()
        self._models.clear()
        self._recent.clear()

    def level(self, model: str, dimension: Dimension, now_s: float) -> float:
        bucket = self._bucket(model, dimension, now_s)
        return bucket.level

    def admit(self, model: str, *, input_tokens: int, now_s: float) -> Refusal | None:
        """Take one request and its input tokens, or say why not (nothing is taken)."""
        needs: dict[Dimension, float] = {
            "requests": 1.0,
            "input_tokens": float(min(input_tokens, self.limit.input_tokens)),
            "output_tokens": 1.0,  # any output left at all
        }
        waits = {d: self._wait_s(model, d, needed, now_s) for d, needed in needs.items()}
        short = {d: wait for d, wait in waits.items() if wait is not None}
        if short:
            dimension = max(short, key=lambda d: short[d])
            return Refusal(dimension, max(1, math.ceil(short[dimension])))
        self._take(model, "requests", 1.0, now_s)
        self._take(model, "input_tokens", needs["input_tokens"], now_s)
        return None

    def take_output(self, model: str, tokens: int, now_s: float) -> None:
        self._take(model, "output_tokens", float(tokens), now_s)

    def _wait_s(
        self, model: str, dimension: Dimension, needed: float, now_s: float
    ) -> float | None:
        """How long until `needed` fits both the bucket and the short interval; None: now."""
        level = self.level(model, dimension, now_s)
        waits = [(needed - level) / self.limit.rate_per_s(dimension)] if level < needed else []
        interval_s, most = self.limit.short_interval_s, self.limit.short_capacity(dimension)
        if interval_s is not None and most is not None:
            recent = self._recent_of(model, dimension, now_s)
            needed = min(needed, most)  # a call bigger than the interval's share goes alone
            taken = sum(amount for _, amount in recent)
            for at_s, amount in recent:  # the oldest age out first
                if taken + needed <= most + 1e-9:
                    break
                taken -= amount
                waits.append(at_s + interval_s - now_s)
        return max(waits) if waits else None

    def _recent_of(
        self, model: str, dimension: Dimension, now_s: float
    ) -> deque[tuple[float, float]]:
        recent = self._recent.setdefault((model, dimension), deque())
        interval_s = self.limit.short_interval_s or 0.0
        while recent and recent[0][0] <= now_s - interval_s + 1e-9:  # float-safe
            recent.popleft()
        return recent

    def headers(self, model: str, *, now_s: float, now_unix_s: float) -> dict[str, str]:
        headers = {}
        for dimension in DIMENSIONS:
            capacity = self.limit.capacity(dimension)
            level = self.level(model, dimension, now_s)
            full_in_s = (capacity - level) / self.limit.rate_per_s(dimension)
            name = f"anthropic-ratelimit-{_HEADER[dimension]}"
            headers[f"{name}-limit"] = str(capacity)
            headers[f"{name}-remaining"] = str(max(0, math.floor(level)))
            headers[f"{name}-reset"] = rfc3339(now_unix_s + full_in_s)
        return headers

    def _bucket(self, model: str, dimension: Dimension, now_s: float) -> _Bucket:
        capacity = self.limit.capacity(dimension)
        bucket = self._models.setdefault((model, dimension), _Bucket(capacity, now_s))
        refill = (now_s - bucket.at_s) * self.limit.rate_per_s(dimension)
        bucket.level = min(capacity, bucket.level + max(refill, 0.0))
        bucket.at_s = now_s
        return bucket

    def _take(self, model: str, dimension: Dimension, amount: float, now_s: float) -> None:
        self._bucket(model, dimension, now_s).level -= amount
        if self.limit.short_interval_s is not None:
            self._recent_of(model, dimension, now_s).append((now_s, amount))


def input_tokens_of(body: Mapping[str, object]) -> int:
    """A request's input tokens as the limits count them: its characters / 4."""
    sent = {key: body.get(key) for key in ("system", "messages", "tools")}
    return len(json.dumps(sent, separators=(",", ":"), default=str)) // 4


def rfc3339(unix_s: float) -> str:
    """`2026-12-01T10:00:00.250Z`, as the API writes its reset times."""
    moment = datetime.fromtimestamp(unix_s, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
