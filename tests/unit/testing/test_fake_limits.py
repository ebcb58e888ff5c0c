"""The fake server's limits over a short interval: a per-minute bucket also enforced per
second, as the API documents it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cmdop_worker.testing.fake_limits import Buckets, RateLimit

MILLISECONDS = st.integers(min_value=0, max_value=5000).map(lambda ms: ms / 1000)
PER_SECOND = RateLimit(requests=240, short_interval_s=1.0)  # 4 in any second


def admitted(limits: Buckets, times_s: list[float], input_tokens: int = 10) -> list[float]:
    return [at for at in times_s if limits.admit("m", input_tokens=input_tokens, now_s=at) is None]


def test_a_burst_within_the_minutes_bucket_is_refused_past_the_seconds_share() -> None:
    limits = Buckets(PER_SECOND)
    assert admitted(limits, [0.0] * 4) == [0.0] * 4
    refusal = limits.admit("m", input_tokens=10, now_s=0.5)
    assert refusal is not None and refusal.dimension == "requests"
    assert refusal.retry_after_s == 1  # whole seconds, as the API sends it
    assert limits.admit("m", input_tokens=10, now_s=1.0) is None  # the first aged out


def test_without_a_short_interval_the_whole_bucket_may_go_at_once() -> None:
    limits = Buckets(RateLimit(requests=240))
    assert len(admitted(limits, [0.0] * 240)) == 240
    assert limits.admit("m", input_tokens=10, now_s=0.0) is not None


def test_requests_spaced_by_the_minutes_rate_are_all_admitted() -> None:
    limits = Buckets(PER_SECOND)
    times = [n * 0.25 for n in range(100)]  # 240 a minute, evenly
    assert admitted(limits, times) == times


def test_input_tokens_are_enforced_per_second_too() -> None:
    limits = Buckets(RateLimit(input_tokens=6000, short_interval_s=1.0))  # 100 a second
    assert limits.admit("m", input_tokens=60, now_s=0.0) is None
    refusal = limits.admit("m", input_tokens=60, now_s=0.1)
    assert refusal is not None and refusal.dimension == "input_tokens"
    assert limits.admit("m", input_tokens=40, now_s=0.1) is None  # what is left of the second
    # A call bigger than a second's share goes alone, once the second is empty.
    assert limits.admit("m", input_tokens=500, now_s=1.05) is not None
    assert limits.admit("m", input_tokens=500, now_s=1.11) is None


def test_output_taken_in_the_second_holds_the_next_call_back() -> None:
    limits = Buckets(RateLimit(output_tokens=600, short_interval_s=1.0))  # 10 a second
    assert limits.admit("m", input_tokens=1, now_s=0.0) is None
    limits.take_output("m", 10, now_s=0.2)
    refusal = limits.admit("m", input_tokens=1, now_s=0.5)
    assert refusal is not None and refusal.dimension == "output_tokens"
    assert limits.admit("m", input_tokens=1, now_s=1.2) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(MILLISECONDS, min_size=1, max_size=60))
def test_no_second_ever_holds_more_than_its_share(arrivals: list[float]) -> None:
    limits = Buckets(PER_SECOND)
    times = sorted(arrivals)
    kept = admitted(limits, times)
    for n, at in enumerate(kept):
        within = [other for other in kept[: n + 1] if other > at - 1.0 + 1e-9]
        assert len(within) <= 4, (at, kept)
    # Whatever was refused found a full second: four admitted within the second before it.
    for at in times:
        if at not in kept:
            assert sum(1 for other in kept if at - 1.0 + 1e-9 < other <= at) >= 4


@settings(max_examples=100, deadline=None)
@given(st.lists(MILLISECONDS, min_size=1, max_size=40))
def test_a_refusals_retry_after_is_time_enough(arrivals: list[float]) -> None:
    limits = Buckets(PER_SECOND)
    for at in sorted(arrivals):
        refusal = limits.admit("m", input_tokens=10, now_s=at)
        if refusal is not None:
            assert limits.admit("m", input_tokens=10, now_s=at + refusal.retry_after_s) is None
            break
