"""The model client's side of eager dispatch, against the fake server and the real SDK.

`on_block` sees each whole block as its `content_block_stop` arrives. A call that has
sent one on (returned True) is committed: a stream failing afterwards is not retried,
and the call returns the whole blocks it got. A tool input cut short (`max_tokens`) is
never offered as whole.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.core.step import ModelReply
from cmdop_worker.llm.client import AnthropicModel, RetryNotice
from cmdop_worker.llm.wire import ReplyStream
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

LONG = " ".join(f"w{i}" for i in range(30))
CALL = {"type": "tool_use", "id": "toolu_a", "name": "execute_command", "input": {"command": "ls"}}
REPLY = [{"type": "text", "text": "looking"}, CALL, {"type": "text", "text": LONG}]
# message_start, ping, the first text's 3 events and the call's 5 (start, 3 deltas, stop).
AFTER_THE_CALL = 12


class Offered:
    """An `on_block` that records what it was offered and sends on every tool call."""

    def __init__(self, *, commit: bool) -> None:
        self.commit = commit
        self.blocks: list[dict[str, Any]] = []
        self.partials: list[ModelReply] = []

    def __call__(self, block: dict[str, Any] | None, partial: Callable[[], ModelReply]) -> bool:
        if block is None:  # an event that closed no whole block
            return False
        self.blocks.append(block)
        self.partials.append(partial())
        return self.commit and block["type"] == "tool_use"


def complete(
    fake: FakeAnthropic, name: str, turn: Any, on_block: Offered
) -> tuple[ModelReply, list[RetryNotice], int]:
    fake.reset()
    fake.add_script(name, [turn])
    settings = Settings(anthropic_base_url=fake.url, anthropic_api_key="k", llm_attempts=3)
    model = AnthropicModel(settings, sleep=lambda s: None)
    notices: list[RetryNotice] = []
    try:
        reply = model.complete(
            {
                "model": "m",
                "max_tokens": 100,
                "messages": [{"role": "user", "content": f"[[script:{name}]] go"}],
            },
            stream=True,
            emit=lambda kind, text: None,
            watch=None,
            deadline_s=time.monotonic() + 60,
            on_retry=notices.append,
            on_block=on_block,
        )
    finally:
        model.close()
    return reply, notices, len(fake.requests())


def test_each_whole_block_is_offered_as_it_closes(fake: FakeAnthropic) -> None:
    offered = Offered(commit=False)
    reply, _, requests = complete(fake, "whole", REPLY, offered)
    assert [b["type"] for b in offered.blocks] == ["text", "tool_use", "text"]
    assert offered.blocks[1]["input"] == {"command": "ls"}
    # With each block: the reply as far as it is whole, the block included.
    assert [len(p.content) for p in offered.partials] == [1, 2, 3]
    assert reply.content == offered.partials[-1].content and requests == 1


@pytest.mark.parametrize("kind", ["truncate", "error_event"])
def test_a_committed_call_is_not_retried_and_keeps_its_whole_blocks(
    fake: FakeAnthropic, kind: str
) -> None:
    fault = {"kind": kind, "after_events": AFTER_THE_CALL, "times": 3}
    reply, notices, requests = complete(
        fake, f"cut{kind}", {"content": REPLY, "fault": fault}, Offered(commit=True)
    )
    assert requests == 1 and notices == []
    assert [b["type"] for b in reply.content] == ["text", "tool_use"]
    assert reply.stop_reason == "tool_use" and reply.tool_uses[0]["input"] == {"command": "ls"}


def test_an_uncommitted_call_is_retried_as_before(fake: FakeAnthropic) -> None:
    fault = {"kind": "truncate", "after_events": AFTER_THE_CALL, "times": 1}
    reply, notices, requests = complete(
        fake, "retried", {"content": REPLY, "fault": fault}, Offered(commit=False)
    )
    assert requests == 2 and [n.cause.split(":")[0] for n in notices] == ["stream_truncated"]
    assert [b["type"] for b in reply.content] == ["text", "tool_use", "text"]


def test_a_call_cut_off_by_max_tokens_is_never_offered_as_whole(fake: FakeAnthropic) -> None:
    cut = {**CALL, "input": {"command": "echo cut-marker", "note": "x" * 60}}
    offered = Offered(commit=True)
    turn = {"content": [{"type": "text", "text": "go"}, cut], "stop_reason": "max_tokens"}
    reply, _, _ = complete(fake, "maxed", turn, offered)
    assert [b["type"] for b in offered.blocks] == ["text"]  # the cut call was not offered
    assert reply.stop_reason == "max_tokens"


def _events(*items: Any) -> list[Any]:
    return [SimpleNamespace(**item) for item in items]


def test_a_call_with_no_input_sent_is_never_whole() -> None:
    """`max_tokens` may cut a call before its first input delta: its `{}` is not whole."""
    stream = ReplyStream()
    start = {"type": "tool_use", "id": "toolu_e", "name": "list_machines", "input": {}}
    block = SimpleNamespace(model_dump=lambda mode: dict(start))
    for event in _events(
        {"type": "content_block_start", "index": 0, "content_block": block},
        {"type": "content_block_stop", "index": 0},
    ):
        stream.feed(event)
    assert stream.whole_block(0) is None and stream.completed() == []


def test_a_committed_reply_counts_at_least_the_tokens_it_wrote(fake: FakeAnthropic) -> None:
    fault = {"kind": "truncate", "after_events": AFTER_THE_CALL, "times": 3}
    reply, _, _ = complete(
        fake, "counted", {"content": REPLY, "fault": fault}, Offered(commit=True)
    )
    written = len(json.dumps(reply.content, separators=(",", ":"))) // 4
    assert reply.usage.output_tokens >= written > 1
