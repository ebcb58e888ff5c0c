"""Retry policy: what is retried, delay bounds, server hints."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmdop_worker.core.retry import (
    RETRYABLE_STATUS,
    FailureKind,
    backoff_delay_s,
    is_retryable,
    retry_after_s,
)

KINDS: list[FailureKind] = [
    "status",
    "connection",
    "timeout",
    "stream_error",
    "stream_truncated",
    "malformed",
]


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
@pytest.mark.parametrize("kind", KINDS)
def test_client_errors_never_retried(status: int, kind: FailureKind) -> None:
    assert is_retryable(status=status, kind=kind) is False


@pytest.mark.parametrize("status", sorted(RETRYABLE_STATUS | {501, 505, 599}))
def test_retryable_statuses(status: int) -> None:
    assert is_retryable(status=status, kind="status") is True


@pytest.mark.parametrize(
    ("status", "kind", "expected"),
    [
        (None, "connection", True),
        (None, "timeout", True),
        (None, "stream_error", True),
        (None, "stream_truncated", True),
        (None, "malformed", True),
        (200, "malformed", True),
        (None, "status", False),
        (402, "status", False),
        (418, "status", False),
        (302, "status", False),
    ],
)
def test_other_failures(status: int | None, kind: FailureKind, expected: bool) -> None:
    assert is_retryable(status=status, kind=kind) is expected


@pytest.mark.parametrize(
    ("attempt", "jitter", "expected"),
    [
        (1, 0.0, 0.5),  # the floor: never below the base
        (1, 0.5, 0.5),
        (2, 0.0, 0.5),
        (2, 0.5, 0.75),
        (3, 0.0, 1.0),
        (7, 0.0, 16.0),
        (7, 0.999, 31.984),
        (8, 0.0, 16.0),
        (50, 0.0, 16.0),
        (10_000, 0.5, 24.0),
    ],
)
def test_backoff_curve(attempt: int, jitter: float, expected: float) -> None:
    assert backoff_delay_s(attempt, jitter=jitter) == pytest.approx(expected)


@given(
    attempt=st.integers(1, 10_000),
    jitter=st.floats(0.0, 1.0, exclude_max=True),
    base_s=st.floats(0.01, 5.0),
    max_s=st.floats(5.0, 120.0),
)
def test_every_delay_is_bounded(attempt: int, jitter: float, base_s: float, max_s: float) -> None:
    delay = backoff_delay_s(attempt, base_s=base_s, max_s=max_s, jitter=jitter)
    uncapped = base_s * 2 ** min(attempt - 1, 64)
    assert min(uncapped, max_s) * 0.5 <= delay < min(uncapped, max_s) + 1e-9
    assert base_s <= delay <= max_s


@given(jitter=st.floats(0.0, 1.0, exclude_max=True))
def test_the_first_backoff_is_at_least_500_ms(jitter: float) -> None:
    # The spec's curve starts at 500 ms; jitter spreads later waits, never the floor.
    assert backoff_delay_s(1, jitter=jitter) >= 0.5
    assert backoff_delay_s(1, base_s=0.02, jitter=jitter) >= 0.02  # a configured base


@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [
        (10.0, 10.0),  # longer than the backoff: the server wins
        (0.1, 1.0),  # shorter: the backoff stands
        (500.0, 64.0),  # capped at twice max_s
        (None, 1.0),
    ],
)
def test_retry_after_wins_when_longer(retry_after: float | None, expected: float) -> None:
    assert backoff_delay_s(3, jitter=0.0, retry_after_s=retry_after) == expected


@pytest.mark.parametrize(("attempt", "jitter"), [(0, 0.0), (-1, 0.5), (1, 1.0), (1, -0.1)])
def test_backoff_rejects_bad_arguments(attempt: int, jitter: float) -> None:
    with pytest.raises(ValueError):
        backoff_delay_s(attempt, jitter=jitter)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"retry-after": "7"}, 7.0),
        ({"Retry-After": "1.5"}, 1.5),
        ({"retry-after-ms": "250"}, 0.25),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
        ({"retry-after-ms": "junk", "retry-after": "9"}, 9.0),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),
        ({"retry-after": "-3"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "inf"}, None),
    ],
)
def test_retry_after_header(headers: dict[str, str], expected: float | None) -> None:
    assert retry_after_s(headers) == expected
