"""The model seam's side of the fleet rate limiter: wait for a slot, learn, settle.

`FleetLimiter` is two things to `AnthropicModel`:

- an SDK middleware (`handle`), run once per HTTP attempt, that reads every response's
  `anthropic-ratelimit-*` headers as soon as they arrive (a stream's too, before its
  first event). On a 429 or 529 it tells the shared limiter at once and so pauses the
  model for the whole fleet (the server's `retry-after`, else `default_pause_s`); so it
  does for the probe (the first call, which the fleet waits on) and any other failure.
  A successful response's headers ride on its ticket instead, and are told with the
  call's settlement: one Redis round trip per response, not two;
- `admit`, called by the retry loop before every attempt: it waits for the limiter's
  slot, with the turn's cancel watch and deadline (a ui cancel ends the wait at once; a
  wait that would pass the deadline is not begun), reporting the wait as a `RETRY`
  notice with cause `rate_limit_wait` — a wait is not a failed attempt; and `settle`,
  after it, correcting the reservation by the usage the reply reports.

The limiter never fails a call: when Redis cannot answer, calls go as if it were off
(logged). The policy (what a response says, what a call costs, the scope) is the pure
`core.ratelimit`; the shared state is `state.ratelimit`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import anthropic

from cmdop_worker import metrics
from cmdop_worker.config import Settings
from cmdop_worker.core.ratelimit import (
    Allowance,
    Cost,
    Dimension,
    allowances,
    fleet_pause_s,
    limiter_scope,
    request_cost,
    usage_cost,
)
from cmdop_worker.core.retry import retry_after_s
from cmdop_worker.errors import ModelError
from cmdop_worker.models import Usage
from cmdop_worker.state.connect import Redis, RedisError
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.outage import OUTAGE
from cmdop_worker.state.ratelimit import Grant, RateLimits

log = logging.getLogger(__name__)
_GO = Grant(0, 0, "go")


def fleet_limiter(settings: Settings, client: Redis, keys: Keys) -> FleetLimiter | None:
    """The fleet's shared rate limiter in this Redis; None when it is off."""
    if settings.rate_limiter == "off":
        return None
    key = settings.anthropic_api_key.get_secret_value() if settings.anthropic_api_key else ""
    return FleetLimiter(
        RateLimits(client, keys),
        endpoint=settings.anthropic_base_url or "https://api.anthropic.com",
        api_key=key,
        # The shortest first backoff: the coordinator that met the 529 waits it out anyway.
        default_pause_s=settings.llm_backoff_base_s / 2,
    )


@dataclass(frozen=True)
class Heard:
    """What a successful response's headers said, and when (monotonic seconds)."""

    stated: dict[Dimension, Allowance]
    at_s: float

    def now(self, now_s: float) -> dict[Dimension, Allowance]:
        """The allowances as of `now_s`: each bucket that much nearer full."""
        gone_ms = max(0.0, now_s - self.at_s) * 1000
        return {
            d: a
            if a.reset_in_ms is None
            else replace(a, reset_in_ms=max(0.0, a.reset_in_ms - gone_ms))
            for d, a in self.stated.items()
        }


@dataclass
class Ticket:
    """One admitted attempt: where it drew from, what it reserved, whether it is the
    probe, and what its response said once heard (told with its settlement)."""

    scope: str
    cost: Cost
    model: str = ""
    probing: bool = False
    heard: Heard | None = None


@dataclass(frozen=True)
class Wait:
    """A wait for the limiter, as the retry loop reports it."""

    model: str
    delay_s: float
    reason: str

    @property
    def cause(self) -> str:
        return f"rate_limit_wait: {self.model} ({self.reason})"


class FleetLimiter(anthropic.Middleware):
    def __init__(
        self,
        limits: RateLimits,
        *,
        endpoint: str,
        api_key: str,
        default_pause_s: float,
        wall_s: Callable[[], float] = time.time,
        monotonic_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.endpoint = endpoint
        self.api_key = api_key
        self.default_pause_s = default_pause_s
        self.wall_s = wall_s
        self.monotonic_s = monotonic_s
        # The attempt this thread was admitted for: the SDK runs the middleware in the
        # thread that sends the request.
        self._current = threading.local()

    def scope(self, model: str) -> str:
        return limiter_scope(endpoint=self.endpoint, api_key=self.api_key, model=model)

    # --- the SDK middleware: every response teaches the fleet ---------------------------

    def handle(self, request: Any, call_next: Any) -> Any:
        response = call_next(request)
        body = request.options.json_data
        model = body.get("model") if isinstance(body, Mapping) else None
        if isinstance(model, str) and model:
            self.learn(model, response.status_code, response.headers)
        return response

    def learn(self, model: str, status: int, headers: Mapping[str, str]) -> None:
        stated = allowances(headers, now_unix_s=self.wall_s())
        pause_s = fleet_pause_s(
            status, retry_after_s=retry_after_s(headers), backoff_s=self.default_pause_s
        )
        ticket: Ticket | None = getattr(self._current, "ticket", None)
        if ticket is not None and _told_later(ticket, model, status):
            ticket.heard = Heard(stated, self.monotonic_s())
            return
        if pause_s is not None:
            metrics.MODEL_RATE_LIMITED.labels(status=str(status)).inc()
            log.warning(
                "model %s answered %s: the fleet holds off for %.2fs", model, status, pause_s
            )
        try:
            self.limits.learn(
                self.scope(model), stated, pause_ms=None if pause_s is None else pause_s * 1000
            )
        except RedisError as exc:
            OUTAGE.failed("rate limiter: not learning from a response", exc)

    # --- the retry loop's side --------------------------------------------------------------

    def admit(
        self,
        request: Mapping[str, Any],
        *,
        time_left_s: Callable[[], float],
        wait: Callable[[float], None],
        on_wait: Callable[[Wait], None],
    ) -> Ticket:
        """Wait until the fleet may send `request`. `wait` sleeps (raising `StopNow` on a
        ui cancel); `on_wait` hears of each wait whose reason changed."""
        model = str(request.get("model", ""))
        ticket = Ticket(self.scope(model), request_cost(request), model)
        self._current.ticket = None
        held: int | None = None
        reason, waited_s = "", 0.0
        while (grant := self._acquire(ticket, held)).wait_ms > 0:
            delay_s = grant.wait_ms / 1000
            if delay_s >= time_left_s():
                self._give_back(ticket, grant)
                raise ModelError(
                    "deadline", f"the rate limit of {model} holds calls past the run's deadline"
                )
            if grant.reason != reason:
                on_wait(Wait(model, delay_s, grant.reason))
            reason = grant.reason
            try:
                wait(delay_s)
            except BaseException:
                self._give_back(ticket, grant)
                raise
            waited_s += delay_s
            held = grant.epoch if grant.reason == "pace" else None
        if waited_s:
            metrics.RATE_LIMIT_WAIT_SECONDS.observe(waited_s)
        ticket.probing = grant.reason == "probe"
        self._current.ticket = ticket
        return ticket

    def settle(self, ticket: Ticket, usage: Usage | None) -> None:
        """Correct the reservation by what the call drew (`usage` of its reply), and
        tell what its response said, in one round trip."""
        if getattr(self._current, "ticket", None) is ticket:
            self._current.ticket = None
        correction = None if usage is None else usage_cost(usage).minus(ticket.cost)
        heard, ticket.heard = ticket.heard, None
        try:
            if heard is not None:
                stated = heard.now(self.monotonic_s())
                self.limits.learn(ticket.scope, stated, pause_ms=None, correction=correction)
            elif correction is not None:
                self.limits.settle(ticket.scope, correction)
        except RedisError as exc:
            OUTAGE.failed("rate limiter: not settling a call", exc)

    def _acquire(self, ticket: Ticket, held: int | None) -> Grant:
        try:
            return self.limits.acquire(ticket.scope, ticket.cost, held_epoch=held)
        except RedisError as exc:
            OUTAGE.failed("rate limiter: calling the model without it", exc)
            return _GO

    def _give_back(self, ticket: Ticket, grant: Grant) -> None:
        if grant.reason != "pace":  # only a pace wait holds a reserved slot
            return
        try:
            self.limits.settle(ticket.scope, Cost().minus(ticket.cost))
        except RedisError:
            log.debug("rate limiter unreachable; a reserved slot is not given back")


def _told_later(ticket: Ticket, model: str, status: int) -> bool:
    """Whether a response is told with its call's settlement: a success, not the probe's
    (the fleet waits on that one)."""
    return 200 <= status < 300 and ticket.model == model and not ticket.probing


def _sooner(allowance: Allowance, gone_ms: float) -> Allowance:
    if allowance.reset_in_ms is None:
        return allowance
    return replace(allowance, reset_in_ms=max(0.0, allowance.reset_in_ms - gone_ms))
