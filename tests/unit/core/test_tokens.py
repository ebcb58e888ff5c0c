"""The token gate: across attempts, no client sees a fragment twice."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cmdop_worker.core.tokens import TokenGate


def feed_all(gate: TokenGate, chunks: list[str]) -> str:
    gate.new_attempt()
    return "".join(gate.feed(chunk) for chunk in chunks)


def test_a_retry_that_repeats_the_text_emits_only_what_is_new() -> None:
    gate = TokenGate()
    assert feed_all(gate, ["Hello ", "wor"]) == "Hello wor"
    assert feed_all(gate, ["Hel", "lo world", "!"]) == "ld!"
    assert gate.emitted == "Hello world!"


def test_a_diverging_retry_emits_nothing_more() -> None:
    gate = TokenGate()
    feed_all(gate, ["Hello there"])
    assert feed_all(gate, ["Goodbye", " and more"]) == ""
    assert gate.emitted == "Hello there"


def test_a_non_streamed_answer_completes_the_streamed_prefix() -> None:
    gate = TokenGate()
    feed_all(gate, ["The disk is "])
    assert gate.rest_of("The disk is 80% full.") == "80% full."


@given(
    st.text(min_size=1, max_size=60),
    st.lists(st.integers(min_value=1, max_value=10), min_size=1, max_size=10),
    st.integers(min_value=0, max_value=60),
)
def test_same_text_in_any_chunking_is_emitted_exactly_once(
    text: str, sizes: list[int], cut: int
) -> None:
    def chunked(value: str) -> list[str]:
        out, i, k = [], 0, 0
        while i < len(value):
            out.append(value[i : i + sizes[k % len(sizes)]])
            i += sizes[k % len(sizes)]
            k += 1
        return out

    gate = TokenGate()
    first = feed_all(gate, chunked(text[:cut]))
    second = feed_all(gate, chunked(text))
    assert first + second == text
