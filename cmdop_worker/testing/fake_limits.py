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

The default limits are high enough that nothing the tests or benchmarks do reaches
them unless they set lower ones (`PUT /_fake/rate_limit`). Input tokens are counted
as the request's characters / 4, cache reads included. No clock here: the shell
(`fake_state`) passes the time in.
"""

from __future__ import annotations

import json
import math
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

    def capacity(self, dimension: Dimension) -> int:
        return int(getattr(self, dimension))

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
        return f"fake: rate limit of {self.dimension.replace('_', ' ')} per window exceeded"


@dataclass
class Buckets:
    """Every model's buckets under one `RateLimit`; not thread-safe (the shell locks)."""

    limit: RateLimit = field(default_factory=RateLimit)
    _models: dict[tuple[str, Dimension], _Bucket] = field(default_factory=dict)

    def reset(self, limit: RateLimit | None = None) -> None:
        self.limit = limit or RateLimit()
        self._models.clear()

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
        short = {
            d: (needed - self.level(model, d, now_s)) / self.limit.rate_per_s(d)
            for d, needed in needs.items()
            if self.level(model, d, now_s) < needed
        }
        if short:
            dimension = max(short, key=lambda d: short[d])
            return Refusal(dimension, max(1, math.ceil(short[dimension])))
        self._take(model, "requests", 1.0, now_s)
        self._take(model, "input_tokens", needs["input_tokens"], now_s)
        return None

    def take_output(self, model: str, tokens: int, now_s: float) -> None:
        self._take(model, "output_tokens", float(tokens), now_s)

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


def input_tokens_of(body: Mapping[str, object]) -> int:
    """A request's input tokens as the limits count them: its characters / 4."""
    sent = {key: body.get(key) for key in ("system", "messages", "tools")}
    return len(json.dumps(sent, separators=(",", ":"), default=str)) // 4


def rfc3339(unix_s: float) -> str:
    """`2026-12-01T10:00:00.250Z`, as the API writes its reset times."""
    moment = datetime.fromtimestamp(unix_s, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
