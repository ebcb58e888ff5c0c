"""Converting the anthropic SDK's replies into the loop's plain values.

Called by `llm`. `reply_of` converts the `Message` of a non-streaming call;
`ReplyStream` folds the raw events of a streaming call into the same `ModelReply`.
Only the block types the Messages API accepts back in history are kept, with only the
fields it accepts, so a stored reply can be sent again verbatim on the next turn (and
stays byte-identical for prompt caching): a streamed reply and a non-streamed one of
the same content give equal block dicts, with the same key order.

Why not the SDK's `MessageStream`: its accumulator re-parses a tool input's whole JSON
buffer (jiter, partial mode) at every `input_json_delta`, which is quadratic in the
input's size (a 60 KB `write_file` arriving in 3,000 deltas cost about 0.55 s of CPU),
and it builds an extra event object per delta. `ReplyStream` keeps each block's
pieces in a list, joins them once, and parses a tool input with `json.loads` once, at
its `content_block_stop` (an empty buffer keeps the start's input, `{}`; an input cut
short by `max_tokens` is read as far as it goes, with jiter's partial mode, once, as the
SDK would). Otherwise it follows the SDK's folding rules:

- message_start: the stop reason and usage; content_block_start: the block as sent;
- text_delta, thinking_delta: appended, and handed back to be streamed to clients;
  signature_delta replaces the signature; citations_delta appends a citation; each
  only to a block of the matching type, as the SDK does;
- message_delta: the stop reason; usage counts are cumulative, so `output_tokens`
  overwrites and the optional counts overwrite only when present;
- message_stop: the reply is complete. A stream that ends before it raises
  `StreamIncomplete`; a tool input that is not JSON raises `ValueError`.

`whole_block` and `completed` give the blocks closed so far, for eager dispatch: a
block counts as whole once its `content_block_stop` arrived and, for a tool call, its
input was complete JSON. One read in partial mode was cut short, and one with no input
at all may have been (`max_tokens` before its first delta): neither ever counts.
`partial_reply` is what a stream cut short after such blocks keeps: those blocks, in
order, with the usage reported so far — and, as the output tokens are reported only at
the end, at least the estimate of the blocks' size (characters / 4, as `core.clearing`
estimates a history), so a budget is not undercounted.

Unknown event, block and delta types are ignored (forward compatible). `ping` and
`error` events never get here: the SDK's `Stream` skips the first and raises
`APIStatusError` for the second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import jiter

from cmdop_worker.core.clearing import CHARS_PER_TOKEN
from cmdop_worker.core.step import ModelReply
from cmdop_worker.models import Usage

_BLOCK_KEYS = {
    "text": ("type", "text"),
    "thinking": ("type", "thinking", "signature"),
    "redacted_thinking": ("type", "data"),
    "tool_use": ("type", "id", "name", "input"),
}
# The block types whose input the SDK's accumulator builds from `input_json_delta`.
_TRACKS_INPUT = frozenset({"tool_use", "server_tool_use"})
# Usage counts a `message_delta` carries only when they apply.
_OPTIONAL_USAGE = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
_USAGE = ("output_tokens", *_OPTIONAL_USAGE)

Streamed = tuple[Literal["text", "thinking"], str]


class StreamIncomplete(Exception):
    """The stream ended before its `message_stop` event."""


def reply_of(message: Any) -> ModelReply:
    content = [_kept(block.model_dump(mode="json")) for block in message.content]
    return _reply(content, message.stop_reason, message.usage, message)


def _reply(
    content: list[dict[str, Any] | None], stop_reason: Any, usage: Any, message: Any
) -> ModelReply:
    return ModelReply(
        content=[b for b in content if b is not None],
        stop_reason=stop_reason,
        model=getattr(message, "model", None),
        response_id=getattr(message, "id", None),
        usage=Usage(
            input_tokens=usage.input_tokens or 0,
            output_tokens=usage.output_tokens or 0,
            cache_read_input_tokens=getattr(usage, "cache_read_input_tokens", None) or 0,
            cache_creation_input_tokens=getattr(usage, "cache_creation_input_tokens", None) or 0,
        ),
    )


def _kept(data: dict[str, Any]) -> dict[str, Any] | None:
    keys = _BLOCK_KEYS.get(data.get("type", ""))
    if keys is None:
        return None
    return {k: data[k] for k in keys if k in data and data[k] is not None}


@dataclass
class _Block:
    fields: dict[str, Any]  # as content_block_start sent them, JSON-mode
    pieces: list[str] = field(default_factory=list)  # text, thinking or tool-input JSON
    closed: bool = False
    cut_short: bool = False  # a tool input read in partial mode, or none: never whole

    @property
    def kind(self) -> Any:
        return self.fields.get("type")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.kind in ("text", "thinking"):
            self.fields[self.kind] = (self.fields.get(self.kind) or "") + "".join(self.pieces)
        elif self.kind in _TRACKS_INPUT:
            raw = "".join(self.pieces)
            self.cut_short = not raw.strip()  # no input sent: perhaps cut before any
            if raw:
                self.fields["input"] = self._input(raw)
        self.pieces = []

    def _input(self, raw: str) -> Any:
        if not raw:
            return self.fields.get("input")
        try:
            return json.loads(raw)
        except ValueError:
            pass
        self.cut_short = True
        try:  # cut short (max_tokens): what can be read, as the SDK's accumulator gives
            return jiter.from_json(raw.encode(), partial_mode=True)
        except ValueError as exc:
            raise ValueError(f"the input of {self.kind} {self.fields.get('id')}: {exc}") from exc


@dataclass
class _Usage:
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class ReplyStream:
    """A streaming call's reply, built from its raw events in time linear in their size."""

    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}
        self._stop_reason: Any = None
        self._message: Any = None  # message_start's: the response's model and id
        self._usage = _Usage()
        self._complete = False

    def feed(self, event: Any) -> Streamed | None:
        """Fold in one event; the text or thinking it adds, to stream to clients."""
        kind = event.type
        if kind == "content_block_delta":
            return self._delta(self._block(event.index), event.delta)
        if kind == "content_block_start":
            self._blocks[event.index] = _Block(event.content_block.model_dump(mode="json"))
        elif kind == "content_block_stop":
            self._block(event.index).close()
        elif kind == "message_start":
            self._stop_reason = event.message.stop_reason
            self._message = event.message
            self._usage = _Usage(**{k: getattr(event.message.usage, k, None) for k in _USAGE})
        elif kind == "message_delta":
            self._stop_reason = event.delta.stop_reason
            self._usage.output_tokens = event.usage.output_tokens
            for name in _OPTIONAL_USAGE:
                if (value := getattr(event.usage, name, None)) is not None:
                    setattr(self._usage, name, value)
        elif kind == "message_stop":
            self._complete = True
        return None

    def reply(self) -> ModelReply:
        if not self._complete:
            raise StreamIncomplete("the stream ended without message_stop")
        for block in self._blocks.values():
            block.close()
        content = [_kept(block.fields) for block in self._blocks.values()]
        return _reply(content, self._stop_reason, self._usage, self._message)

    def whole_block(self, index: int) -> dict[str, Any] | None:
        """Block `index` as stored, once closed and whole; else None."""
        block = self._blocks.get(index)
        if block is None or not block.closed or block.cut_short:
            return None
        return _kept(block.fields)

    def completed(self) -> list[dict[str, Any]]:
        """Every block closed and whole so far, in order."""
        return [b for i in self._blocks if (b := self.whole_block(i)) is not None]

    def partial_reply(self) -> ModelReply:
        """The reply of a stream cut short: its whole blocks, and a tool call among
        them as the reason it stopped."""
        content: list[dict[str, Any] | None] = list(self.completed())
        stop = "tool_use" if any(b and b.get("type") == "tool_use" for b in content) else None
        written = len(json.dumps(content, separators=(",", ":"))) // CHARS_PER_TOKEN
        usage = replace(self._usage, output_tokens=max(self._usage.output_tokens or 0, written))
        return _reply(content, stop, usage, self._message)

    def _block(self, index: int) -> _Block:
        block = self._blocks.get(index)
        if block is None:
            raise ValueError(f"stream event for content block {index} before its start")
        return block

    def _delta(self, block: _Block, delta: Any) -> Streamed | None:
        kind = delta.type
        if kind == "text_delta" and block.kind == "text":
            block.pieces.append(delta.text)
            return "text", delta.text
        if kind == "thinking_delta" and block.kind == "thinking":
            block.pieces.append(delta.thinking)
            return "thinking", delta.thinking
        if kind == "input_json_delta" and block.kind in _TRACKS_INPUT:
            block.pieces.append(delta.partial_json)
        elif kind == "signature_delta" and block.kind == "thinking":
            block.fields["signature"] = delta.signature
        elif kind == "citations_delta" and block.kind == "text":
            citations = block.fields.get("citations") or []
            block.fields["citations"] = [*citations, delta.citation.model_dump(mode="json")]
        return None
