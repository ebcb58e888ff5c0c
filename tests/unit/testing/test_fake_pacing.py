"""The fake model's pacing: its schedule, the deltas it streams, where its waits go.

No test here measures time: the schedule is pure data (`fake_wire.stream_delays`), and
the HTTP shell's waits are recorded instead of slept.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

import anthropic
import pytest
from pydantic import ValidationError

from cmdop_worker.testing import fake_http
from cmdop_worker.testing import fake_wire as fw
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from cmdop_worker.testing.fake_script import Script
from cmdop_worker.testing.fake_state import _State

MODEL = "claude-fake-1"
INPUT = {"ms": 1500, "machine": "alpha", "note": "look at the web tier's disk usage first"}
TEXT = "I will look at the web tier and then at the database."


def message(*blocks: dict[str, Any]) -> dict[str, Any]:
    content = [
        {**b, "id": f"toolu_{i}"} if b["type"] == "tool_use" else b for i, b in enumerate(blocks)
    ]
    usage = fw.InputUsage(10, 0, 0, ())
    return fw.message_object("msg_1", MODEL, content, usage)


def tool(**input: Any) -> dict[str, Any]:
    return {"type": "tool_use", "name": "bench_sleep", "input": input}


def at(events: list[tuple[str, Any]], delays: list[float], name: str) -> list[float]:
    """The offset (s from the first event) at which each event called `name` goes out."""
    offsets = list(accumulate(delays))
    return [offsets[i] for i, (n, _) in enumerate(events) if n == name]


# --- the schedule (pure) ---------------------------------------------------------------


def test_a_paced_tool_input_streams_in_several_pieces_that_rebuild_it() -> None:
    events = fw.sse_events(message(tool(**INPUT)), paced=True)
    pieces = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert len(pieces) == -(-len(json.dumps(INPUT)) // fw.PACED_JSON_CHARS) > 3
    assert json.loads("".join(pieces)) == INPUT
    assert all(len(p) == fw.PACED_JSON_CHARS for p in pieces[:-1])


def test_unpaced_streams_keep_their_few_pieces() -> None:
    events = fw.sse_events(message(tool(**INPUT)))
    pieces = [d for n, d in events if n == "content_block_delta"]
    assert 2 <= len(pieces) <= 3
    assert fw.stream_delays(events, 0, 0) == [0.0] * len(events)


def test_each_delta_waits_for_its_own_tokens_before_it_goes_out() -> None:
    events = fw.sse_events(message({"type": "text", "text": TEXT}, tool(**INPUT)), paced=True)
    delays = fw.stream_delays(events, 80, 0)
    for (name, data), delay in zip(events, delays, strict=True):
        if name != "content_block_delta":
            assert delay == 0
            continue
        delta = data["delta"]
        chars = len(delta.get("text") or delta.get("partial_json") or "")
        assert delay == pytest.approx(chars / fw.CHARS_PER_TOKEN / 80)


def test_a_first_tool_use_closes_long_before_the_message_stops() -> None:
    tools = [tool(**{**INPUT, "ms": ms}) for ms in (1500, 200, 200, 50)]
    events = fw.sse_events(message(*tools), paced=True)
    delays = fw.stream_delays(events, 80, 0)
    stops, (end,) = at(events, delays, "content_block_stop"), at(events, delays, "message_stop")
    chars = [len(json.dumps(t["input"])) for t in tools]
    assert stops[0] == pytest.approx(fw.token_seconds(chars[0], 80))
    assert stops == sorted(stops) and stops[-1] == pytest.approx(end)
    assert end - stops[0] == pytest.approx(fw.token_seconds(sum(chars[1:]), 80))


def test_a_stream_and_a_whole_reply_take_the_same_token_time() -> None:
    thinking = {"type": "thinking", "thinking": "Two machines, so two calls.", "signature": "s"}
    reply = message(thinking, {"type": "text", "text": TEXT}, tool(**INPUT), tool(a=[1, 2]))
    events = fw.sse_events(reply, paced=True)
    chars = len("Two machines, so two calls.") + len(TEXT)
    chars += len(json.dumps(INPUT)) + len(json.dumps({"a": [1, 2]}))
    assert fw.reply_seconds(reply, 80) == pytest.approx(chars / fw.CHARS_PER_TOKEN / 80)
    assert sum(fw.stream_delays(events, 80, 0)) == pytest.approx(fw.reply_seconds(reply, 80))
    assert fw.reply_seconds(reply, 0) == 0


def test_token_delay_still_follows_every_delta_and_adds_to_the_pace() -> None:
    events = fw.sse_events(message({"type": "text", "text": TEXT}))
    delays = fw.stream_delays(events, 0, 0.01)
    after_delta = [i + 1 for i, (n, _) in enumerate(events) if n == "content_block_delta"]
    assert [i for i, d in enumerate(delays) if d] == after_delta
    paced = fw.stream_delays(events, 80, 0.01)
    assert sum(paced) == pytest.approx(0.01 * len(after_delta) + len(TEXT) / 4 / 80)


# --- which pace a turn gets ------------------------------------------------------------


def body(prompt: str, assistant_turns: int = 0) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for _ in range(assistant_turns):
        messages += [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "more"},
        ]
    return {"model": MODEL, "max_tokens": 64, "messages": messages}


@pytest.mark.parametrize(
    ("script", "server", "expected"),
    [
        ({"turns": [[{"type": "text", "text": "x"}]]}, 0, 0),
        ({"turns": [[{"type": "text", "text": "x"}]]}, 80, 80),
        ({"turns": [[{"type": "text", "text": "x"}]], "pace_tps": 40}, 80, 40),
        ({"turns": [{"content": [{"type": "text", "text": "x"}], "pace_tps": 0}]}, 80, 0),
        (
            {
                "turns": [{"content": [{"type": "text", "text": "x"}], "pace_tps": 20}],
                "pace_tps": 5,
            },
            80,
            20,
        ),
    ],
)
def test_a_turns_pace_wins_over_its_scripts_and_that_over_the_servers(
    script: dict[str, Any], server: float, expected: float
) -> None:
    state = _State(pace_tps=server)
    state.add_script("s", script)
    assert state.answer(body("[[script:s]] go")).pace_tps == expected


def test_a_pace_below_zero_is_refused() -> None:
    with pytest.raises(ValidationError, match="pace_tps"):
        Script.model_validate({"turns": [[{"type": "text", "text": "x"}]], "pace_tps": -1})


# --- the HTTP shell, through the real SDK ------------------------------------------------


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits the server asks for, recorded instead of slept."""
    asked: list[float] = []
    monkeypatch.setattr(fake_http._Handler, "_wait", lambda self, seconds: asked.append(seconds))
    return asked


@pytest.fixture
def paced() -> Iterator[anthropic.Anthropic]:
    turn = [{"type": "text", "text": TEXT}, tool(**INPUT), tool(**{**INPUT, "ms": 50})]
    scripts = {"paced": {"turns": [turn], "pace_tps": 80, "latency_ms": 30}}
    with (
        FakeAnthropic(scripts=scripts) as fake,
        anthropic.Anthropic(base_url=fake.url, api_key="test", max_retries=0) as sdk,
    ):
        yield sdk


def test_a_paced_stream_waits_before_each_delta_and_rebuilds_every_input(
    paced: anthropic.Anthropic, waits: list[float]
) -> None:
    messages: Any = [{"role": "user", "content": "[[script:paced]] go"}]
    with paced.messages.create(model=MODEL, max_tokens=64, messages=messages, stream=True) as s:
        events = list(s)
    parts: dict[int, list[str]] = {}
    for e in events:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            parts.setdefault(e.index, []).append(e.delta.partial_json)
    assert sorted(parts) == [1, 2] and all(len(p) > 3 for p in parts.values())
    assert json.loads("".join(parts[1])) == INPUT
    # The latency first, then one wait before each event (the SDK does not show the
    # ping), the deltas' adding up to the whole reply's token time.
    blocks = [{"type": "text", "text": TEXT}, tool(**INPUT), tool(**{**INPUT, "ms": 50})]
    sent = fw.sse_events(message(*blocks), paced=True)
    assert len(sent) == len(events) + 1 and len(waits) == 1 + len(sent)
    assert waits[0] == pytest.approx(0.03)
    assert sum(waits[1:]) == pytest.approx(fw.reply_seconds(message(*blocks), 80))


def test_a_paced_whole_reply_waits_for_all_of_its_tokens_at_once(
    paced: anthropic.Anthropic, waits: list[float]
) -> None:
    messages: Any = [{"role": "user", "content": "[[script:paced]] go"}]
    reply = paced.messages.create(model=MODEL, max_tokens=64, messages=messages)
    assert [b.type for b in reply.content] == ["text", "tool_use", "tool_use"]
    whole = fw.reply_seconds(message(*[b.model_dump() for b in reply.content]), 80)
    assert waits == [pytest.approx(0.03), pytest.approx(whole)] and whole > 0
