"""The rate limiter's pure parts: reading the provider's headers, a call's cost, the
scope, pauses and the fallback decision; and the fake server's own buckets."""

from __future__ import annotations

import itertools
import json
import math
import urllib.error
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmdop_worker.core.ratelimit import (
    PACE_MARGIN,
    Allowance,
    Cost,
    allowances,
    fallback_switch,
    fleet_pause_s,
    limiter_scope,
    pace_ms,
    paced_slot,
    request_cost,
    unit_ms_bound,
    unix_time,
    usage_cost,
)
from cmdop_worker.models import Usage
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from cmdop_worker.testing.fake_limits import Buckets, RateLimit, input_tokens_of, rfc3339

NOW = 1_796_000_000.0  # 2026-12-01, Unix seconds


def test_allowances_are_read_per_dimension_with_reset_as_milliseconds_from_now() -> None:
    headers = {
        "Anthropic-RateLimit-Requests-Limit": "50",
        "anthropic-ratelimit-requests-remaining": "42",
        "anthropic-ratelimit-requests-reset": rfc3339(NOW + 1.25),
        "anthropic-ratelimit-input-tokens-limit": "30000",
        "anthropic-ratelimit-input-tokens-remaining": "29000",
        "anthropic-ratelimit-input-tokens-reset": rfc3339(NOW - 5),  # already full again
    }
    found = allowances(headers, now_unix_s=NOW)
    assert found.keys() == {"requests", "input_tokens"}
    assert found["requests"].limit == 50 and found["requests"].remaining == 42
    assert found["requests"].reset_in_ms == pytest.approx(1250, abs=1)
    assert found["input_tokens"] == Allowance(30000, 29000, 0.0)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"anthropic-ratelimit-requests-limit": "50"},  # no remaining
        {"anthropic-ratelimit-requests-limit": "x", "anthropic-ratelimit-requests-remaining": "1"},
        {"anthropic-ratelimit-requests-limit": "0", "anthropic-ratelimit-requests-remaining": "0"},
        {"anthropic-ratelimit-requests-limit": "5", "anthropic-ratelimit-requests-remaining": "-1"},
    ],
)
def test_incomplete_or_bad_allowances_are_left_out(headers: dict[str, str]) -> None:
    assert allowances(headers, now_unix_s=NOW) == {}


def test_a_reset_that_is_no_time_is_unknown() -> None:
    headers = {
        "anthropic-ratelimit-requests-limit": "5",
        "anthropic-ratelimit-requests-remaining": "9",  # more than the limit: capped
        "anthropic-ratelimit-requests-reset": "soon",
    }
    assert allowances(headers, now_unix_s=NOW) == {"requests": Allowance(5, 5, None)}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-12-01T10:00:00Z", 1_796_119_200.0),
        ("2026-12-01T10:00:00.250Z", 1_796_119_200.25),
        ("2026-12-01T12:00:00+02:00", 1_796_119_200.0),
        ("2026-12-01T10:00:00", None),  # no zone: not RFC 3339
        ("", None),
        (None, None),
    ],
)
def test_rfc3339_times(text: str | None, expected: float | None) -> None:
    assert unix_time(text) == expected


def test_the_fakes_reset_times_read_back_to_the_millisecond() -> None:
    assert unix_time(rfc3339(NOW + 0.123)) == pytest.approx(NOW + 0.123, abs=0.001)


def test_a_request_costs_one_request_its_size_in_tokens_and_its_max_tokens() -> None:
    request = {
        "model": "m",
        "max_tokens": 700,
        "messages": [{"role": "user", "content": "x" * 400}],
    }
    cost = request_cost(request)
    assert cost.requests == 1 and cost.output_tokens == 700
    assert 100 <= cost.input_tokens <= 120


def test_usage_counts_cache_writes_but_not_cache_reads() -> None:
    usage = Usage(
        input_tokens=10,
        output_tokens=7,
        cache_read_input_tokens=5000,
        cache_creation_input_tokens=300,
    )
    assert usage_cost(usage) == Cost(1, 310, 7)
    assert usage_cost(usage).minus(Cost(1, 400, 700)) == Cost(0, -90, -693)


def test_the_scope_names_the_model_and_hides_the_key() -> None:
    scope = limiter_scope(endpoint="https://api.anthropic.com", api_key="sk-secret", model="m-1")
    assert scope.endswith(":m-1") and "sk-secret" not in scope
    assert scope == limiter_scope(
        endpoint="https://api.anthropic.com", api_key="sk-secret", model="m-1"
    )
    assert scope != limiter_scope(
        endpoint="https://api.anthropic.com", api_key="sk-other", model="m-1"
    )
    assert scope != limiter_scope(endpoint="http://127.0.0.1:9", api_key="sk-secret", model="m-1")


@pytest.mark.parametrize(
    ("status", "retry_after", "expected"),
    [(429, 3.0, 3.0), (429, None, 0.5), (529, None, 0.5), (529, 2.0, 2.0), (500, 3.0, None)],
)
def test_a_429_or_529_pauses_the_fleet(
    status: int, retry_after: float | None, expected: float | None
) -> None:
    assert fleet_pause_s(status, retry_after_s=retry_after, backoff_s=0.5) == expected


@pytest.mark.parametrize(
    ("status", "retryable", "attempt", "has_next", "expected"),
    [
        (529, True, 1, True, "overloaded"),  # at once, not after six tries
        (529, True, 1, False, None),  # nothing to fall back to: retry as before
        (500, True, 2, True, None),  # attempts left on the model
        (500, True, 6, True, "attempts_spent"),
        (None, True, 6, True, "attempts_spent"),  # a connection failure, six times
        (400, False, 1, True, None),  # the request is wrong: another model will not help
        (429, True, 3, True, None),
    ],
)
def test_when_a_call_falls_back(
    status: int | None, retryable: bool, attempt: int, has_next: bool, expected: str | None
) -> None:
    switch = fallback_switch(
        status=status, retryable=retryable, attempt=attempt, attempts=6, has_next=has_next
    )
    assert switch == expected


# --- the fake server's buckets ---------------------------------------------------------


def test_the_fake_admits_its_limit_then_refuses_with_a_whole_second_retry_after() -> None:
    buckets = Buckets(RateLimit(requests=5, window_s=1))
    verdicts = [buckets.admit("m", input_tokens=10, now_s=100.0) for _ in range(6)]
    assert verdicts[:5] == [None] * 5
    refusal = verdicts[5]
    assert refusal is not None and refusal.dimension == "requests"
    assert refusal.retry_after_s == 1
    assert buckets.admit("other-model", input_tokens=10, now_s=100.0) is None  # per model
    assert buckets.admit("m", input_tokens=10, now_s=100.2) is None  # one back in 1/5 s
    assert buckets.admit("m", input_tokens=10, now_s=100.2) is not None


def test_the_fakes_headers_say_what_is_left_and_when_it_is_full() -> None:
    buckets = Buckets(RateLimit(requests=5, output_tokens=1000, window_s=1))
    for _ in range(3):
        assert buckets.admit("m", input_tokens=0, now_s=10.0) is None
    buckets.take_output("m", 250, now_s=10.0)
    headers = buckets.headers("m", now_s=10.0, now_unix_s=NOW)
    assert headers["anthropic-ratelimit-requests-limit"] == "5"
    assert headers["anthropic-ratelimit-requests-remaining"] == "2"
    stated = allowances(headers, now_unix_s=NOW)
    assert stated["requests"].reset_in_ms == pytest.approx(600, abs=1)  # 3 x 200 ms
    assert stated["output_tokens"] == Allowance(1000, 750, pytest.approx(250, abs=1))


def test_output_tokens_in_debt_refuse_the_next_request() -> None:
    buckets = Buckets(RateLimit(output_tokens=100, window_s=1))
    assert buckets.admit("m", input_tokens=0, now_s=0.0) is None
    buckets.take_output("m", 300, now_s=0.0)  # the answer was longer than what was left
    refusal = buckets.admit("m", input_tokens=0, now_s=0.5)
    assert refusal is not None and refusal.dimension == "output_tokens"
    assert refusal.retry_after_s == 2  # -150 at 0.5 s: 151 tokens to come back at 100/s


def test_the_fake_counts_input_as_characters_over_four() -> None:
    body = {"messages": [{"role": "user", "content": "y" * 4000}], "max_tokens": 5}
    assert 1000 <= input_tokens_of(body) <= 1020


def test_the_fake_server_limits_over_http_and_sends_the_headers_on_every_answer() -> None:
    with FakeAnthropic() as fake:
        put = urllib.request.Request(
            f"{fake.url}/_fake/rate_limit",
            data=json.dumps({"requests": 2, "window_s": 60}).encode(),
            method="PUT",
        )
        with urllib.request.urlopen(put, timeout=10) as response:
            assert json.loads(response.read())["requests"] == 2
        answers = [post(fake.url, stream=stream) for stream in (False, True, False)]
    assert [status for status, _ in answers] == [200, 200, 429]
    for _, headers in answers:
        assert headers["anthropic-ratelimit-requests-limit"] == "2"
        assert unix_time(headers["anthropic-ratelimit-requests-reset"]) is not None
    assert [h["anthropic-ratelimit-requests-remaining"] for _, h in answers] == ["1", "0", "0"]
    assert answers[2][1]["retry-after"] == "30"  # a whole request comes back in 30 s


def post(url: str, *, stream: bool) -> tuple[int, dict[str, str]]:
    body = {
        "model": "m",
        "max_tokens": 5,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    }
    request = urllib.request.Request(f"{url}/v1/messages", data=json.dumps(body).encode())
    request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status, {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}


# --- the pace ---------------------------------------------------------------------------

UNIT_MS = 200.0  # 300 a minute


def slots(asks_ms: list[float], unit_ms: float = UNIT_MS) -> list[float]:
    """Each ask's slot, the asks taken in order, through one shared pace."""
    granted, next_ms = [], 0.0
    for now_ms in asks_ms:
        at_ms, next_ms = paced_slot(next_ms, now_ms, unit_ms)
        granted.append(at_ms)
    return granted


ASKS = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=80).map(sorted)


@given(ASKS)
def test_no_two_slots_are_closer_than_a_pace_and_none_comes_before_its_ask(
    asks: list[int],
) -> None:
    granted = slots([float(a) for a in asks])
    assert all(at >= ask for at, ask in zip(granted, asks, strict=True))
    assert all(b - a >= pace_ms(UNIT_MS) - 1e-6 for a, b in itertools.pairwise(granted))


@given(ASKS)
def test_a_caller_waits_only_for_the_callers_before_it(asks: list[int]) -> None:
    granted = slots([float(a) for a in asks])
    for n, (at, ask) in enumerate(zip(granted, asks, strict=True)):
        # Either it went as it asked, or right after the slot before it.
        assert at == ask or (n and at == pytest.approx(granted[n - 1] + pace_ms(UNIT_MS)))


@given(ASKS, st.lists(st.floats(min_value=0, max_value=30), min_size=80, max_size=80))
def test_paced_requests_meet_no_short_interval_refusal_despite_arrival_jitter(
    asks: list[int], jitter_ms: list[float]
) -> None:
    """300 a minute enforced as 5 in any second: requests arriving up to 30 ms after
    their slots, each by its own delay, are all admitted."""
    limits = Buckets(RateLimit(requests=300, short_interval_s=1.0))
    granted = slots([float(a) for a in asks])
    delays = jitter_ms[: len(granted)]
    arrivals = sorted((at + jitter) / 1000 for at, jitter in zip(granted, delays, strict=True))
    refused = [at for at in arrivals if limits.admit("m", input_tokens=1, now_s=at) is not None]
    assert refused == []


def test_a_busy_fleet_uses_all_but_the_margin_of_the_limit() -> None:
    granted = slots([0.0] * 301)  # everybody asks at once
    per_s = 300 / ((granted[-1] - granted[0]) / 1000)
    assert per_s == pytest.approx(1000 / UNIT_MS / (1 + PACE_MARGIN))
    assert per_s >= 0.9 * 1000 / UNIT_MS  # the aim: at least 90% of the limit


@pytest.mark.parametrize(
    ("limit", "remaining", "reset_ms", "bound"),
    [
        (300, 299, 150.0, 150.0),  # one taken, 150 ms until it is back: at least 150
        (300, 290, 2000.0, 200.0),
        (300, 300, 0.0, None),  # full: nothing to go by
        (300, 299, 0.0, None),
    ],
)
def test_the_interval_read_off_a_response_is_a_lower_bound(
    limit: int, remaining: int, reset_ms: float, bound: float | None
) -> None:
    assert unit_ms_bound(limit=limit, remaining=remaining, reset_ms=reset_ms) == bound


@given(
    st.integers(min_value=1, max_value=10_000),
    st.floats(min_value=0.001, max_value=0.999),
    st.floats(min_value=1.0, max_value=1_000.0),
)
def test_the_bound_never_overstates_the_true_interval(
    limit: int, fraction_left: float, unit_ms: float
) -> None:
    level = limit * fraction_left  # the provider's own, unrounded
    reset_ms = (limit - level) * unit_ms
    bound = unit_ms_bound(limit=limit, remaining=math.floor(level), reset_ms=reset_ms)
    assert bound is not None and bound <= unit_ms * (1 + 1e-9)
