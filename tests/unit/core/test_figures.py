"""The figures every screen shows alike: usage, a call's time, the head of its output."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmdop_worker.core.figures import preview, took, usage_line


def test_usage_names_every_kind_of_token_and_the_cost() -> None:
    usage = {
        "input_tokens": 87,
        "cache_read_input_tokens": 2404,
        "cache_creation_input_tokens": 12,
        "output_tokens": 120,
        "cost_usd": 0.012345,
    }
    assert usage_line(usage) == "87 in · 2404 cache read · 12 cache write · 120 out · $0.0123"
    unpriced = {**usage, "cost_usd": None}
    assert usage_line(unpriced).endswith("120 out · cost unknown")
    assert usage_line({}) == "0 in · 0 cache read · 0 cache write · 0 out · $0.0000"


@pytest.mark.parametrize(
    ("duration_ms", "waited_ms", "elapsed_ms", "said"),
    [
        (420, 0, None, "0.42s"),
        (420, 12_000, 12_500, "0.42s, waited 12.0s for approval"),  # its own time, not the wait
        (0, 0, 3_010, "3.01s"),  # answered for it (a cancel): start to end, as the events show
        (0, 0, None, "0.00s"),
    ],
)
def test_a_calls_time_is_its_own_with_the_wait_beside_it(
    duration_ms: int, waited_ms: int, elapsed_ms: int | None, said: str
) -> None:
    assert took(duration_ms, waited_ms, elapsed_ms=elapsed_ms) == said


def test_the_head_of_an_output_skips_what_tells_nothing_and_says_what_is_left() -> None:
    df = (
        "exit_code: 0\n--- stdout ---\nFilesystem Size Used\n/dev/sda1 50G 23G\ntmpfs 1G 0\nx 1 2\n"
    )
    assert preview(df) == [
        "Filesystem Size Used",
        "/dev/sda1 50G 23G",
        "tmpfs 1G 0",
        "… 1 more line",
    ]
    assert preview("exit_code: 0") == ["exit_code: 0"]
    assert preview("") == []
    assert preview("a" * 300, width=10) == ["aaaaaaaaa…"]


@given(st.text(max_size=2000), st.integers(1, 5), st.integers(2, 80))
def test_the_head_is_bounded(output: str, lines: int, width: int) -> None:
    shown = preview(output, lines=lines, width=width)
    assert len(shown) <= lines + 1
    assert all(len(line) <= width for line in shown[:lines])
