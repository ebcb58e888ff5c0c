"""Pure wire logic of the fake Anthropic server: usage, the prompt cache, responses.

Builds the Message object and the SSE event sequence for a rendered turn, the error
bodies and retry headers of status faults, and approximates prompt caching. Called by
`fake_anthropic` (the HTTP shell); nothing here does I/O.

Tokens: one estimate for everything here, `CHARS_PER_TOKEN` characters a token.

Usage: a request is flattened into segments (each tool, each system block, each
message content block, in that order, `cache_control` removed) and every prefix is
hashed (per model). Tokens are characters of the JSON list of segments // 4. A prefix ending on a
block with `cache_control` is written to the cache; a later request reads the longest
remembered prefix that ends at or before its own last breakpoint. No minimum length,
no TTL, no 20-block lookback limit.

Pacing (`pace_tps`, output tokens per second): a block's output is its text, its
thinking, or its tool input's JSON (a signature and redacted thinking cost nothing);
streamed, each delta waits for its own characters' tokens before it goes out, and a
paced tool input streams in pieces of `PACED_JSON_CHARS`, so each tool_use's
`content_block_stop` arrives when its own input is written, well before
`message_stop` when more follows. A reply sent whole waits for all of its tokens
(`reply_seconds`). `stream_delays` is the schedule; the HTTP shell sleeps it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cmdop_worker.testing.fake_script import JsonDict, StatusFault, messages_of

WORDS_PER_DELTA = 3
CHARS_PER_TOKEN = 4
PACED_JSON_CHARS = 4 * CHARS_PER_TOKEN  # a paced input_json_delta carries ~4 tokens


# --- usage and the prompt cache -----------------------------------------------------


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _segment(value: Any, **context: Any) -> tuple[str, bool]:
    if not isinstance(value, dict):
        return _canonical({**context, "value": value}), False
    stripped = {k: v for k, v in value.items() if k != "cache_control"}
    return _canonical({**context, **stripped}), "cache_control" in value


def _segments(body: Mapping[str, Any]) -> Iterator[tuple[str, bool]]:
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        yield _segment(tool, part="tool")
    system = body.get("system")
    for block in system if isinstance(system, list) else ([system] if system else []):
        yield _segment(block, part="system")
    for message in messages_of(body):
        content = message.get("content")
        for block in content if isinstance(content, list) else [content]:
            yield _segment(block, part="message", role=message.get("role"))


@dataclass(frozen=True)
class PrefixPoint:
    key: str
    chars: int
    breakpoint: bool


def prefix_points(body: Mapping[str, Any]) -> list[PrefixPoint]:
    """A hash and a size for each prefix of the request (tools, system, messages)."""
    digest = hashlib.sha256(str(body.get("model", "")).encode())
    chars = 1
    points = []
    for text, breakpoint in _segments(body):
        digest.update(text.encode() + b"\x1e")
        chars += len(text) + 1
        points.append(PrefixPoint(digest.hexdigest(), chars, breakpoint))
    return points


@dataclass(frozen=True)
class InputUsage:
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    written: tuple[str, ...]


def input_usage(points: list[PrefixPoint], cached: Collection[str]) -> InputUsage:
    """Split the input tokens into fresh, cache-written and cache-read ones."""
    total = (points[-1].chars if points else 2) // CHARS_PER_TOKEN
    last_bp = max((i for i, p in enumerate(points) if p.breakpoint), default=-1)
    eligible = points[: last_bp + 1]
    read_chars = max((p.chars for p in eligible if p.key in cached), default=0)
    new = [p for p in eligible if p.breakpoint and p.chars > read_chars and p.key not in cached]
    write_chars = max((p.chars for p in new), default=read_chars)
    read = read_chars // CHARS_PER_TOKEN
    creation = write_chars // CHARS_PER_TOKEN - read
    return InputUsage(total - read - creation, creation, read, tuple(p.key for p in new))


# --- responses ----------------------------------------------------------------------


def stop_reason(blocks: list[JsonDict]) -> str:
    return "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"


def message_object(msg_id: str, model: str, blocks: list[JsonDict], usage: InputUsage) -> JsonDict:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop_reason(blocks),
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage.input_tokens,
            "output_tokens": max(1, len(_canonical(blocks)) // CHARS_PER_TOKEN),
            "cache_creation_input_tokens": usage.cache_creation_input_tokens,
            "cache_read_input_tokens": usage.cache_read_input_tokens,
        },
    }


def text_chunks(text: str, words: int = WORDS_PER_DELTA) -> list[str]:
    """`text` in pieces of a few words each, whitespace kept, so "".join() restores it."""
    pieces = re.findall(r"\s*\S+\s*", text) or [text]
    return ["".join(pieces[i : i + words]) for i in range(0, len(pieces), words)]


def json_chunks(value: Any, piece_chars: int | None = None) -> list[str]:
    """The JSON of `value` in partial pieces, as `input_json_delta` sends it: 2 to 3 of
    them, or pieces of `piece_chars` characters (the last one shorter)."""
    text = json.dumps(value)
    step = piece_chars or max(1, -(-len(text) // 3))
    return [text[i : i + step] for i in range(0, len(text), step)]


def _block_events(
    index: int, block: JsonDict, cut: bool, paced: bool
) -> Iterator[tuple[str, JsonDict]]:
    kind = block["type"]
    if kind == "text":
        start: JsonDict = {"type": "text", "text": "", "citations": None}
        deltas = [{"type": "text_delta", "text": t} for t in text_chunks(block["text"])]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": t} for t in text_chunks(block["thinking"])]
        deltas.append({"type": "signature_delta", "signature": block["signature"]})
    elif kind == "redacted_thinking":  # whole in its start event, as the API sends it
        start, deltas = dict(block), []
    else:
        start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        pieces = json_chunks(block["input"], PACED_JSON_CHARS if paced else None)
        if cut:  # the output limit hit while the model wrote this input
            pieces = pieces[: max(1, len(pieces) // 2)]
        deltas = [{"type": "input_json_delta", "partial_json": p} for p in pieces]
    yield (
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": start},
    )
    for delta in deltas:
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    yield "content_block_stop", {"type": "content_block_stop", "index": index}


def sse_events(message: JsonDict, *, paced: bool = False) -> list[tuple[str, JsonDict]]:
    """The event sequence that streams `message`, ping included, as Anthropic sends it;
    `paced`, tool inputs go in pieces of `PACED_JSON_CHARS`."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    events: list[tuple[str, JsonDict]] = [
        ("message_start", {"type": "message_start", "message": start}),
        ("ping", {"type": "ping"}),
    ]
    blocks = message["content"]
    for index, block in enumerate(blocks):
        # Stopped by max_tokens, a last tool_use is streamed cut off halfway (a reply
        # sent whole keeps its input whole: the loop must not trust it either).
        cut = message["stop_reason"] == "max_tokens" and index == len(blocks) - 1
        events.extend(_block_events(index, block, cut and block["type"] == "tool_use", paced))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


# --- pacing --------------------------------------------------------------------------


def token_seconds(chars: int, pace_tps: float) -> float:
    """How long the model takes to write `chars` characters of output; 0 unpaced."""
    return chars / CHARS_PER_TOKEN / pace_tps if pace_tps > 0 else 0.0


def block_chars(block: JsonDict) -> int:
    """The characters of model output in a content block (what its deltas carry)."""
    if block["type"] == "text":
        return len(block["text"])
    if block["type"] == "thinking":
        return len(block["thinking"])
    if block["type"] == "tool_use":
        return len(json.dumps(block["input"]))
    return 0  # redacted thinking arrives whole, as opaque data


def _delta_chars(delta: JsonDict) -> int:
    field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
    return len(delta[field[delta["type"]]]) if delta["type"] in field else 0


def reply_seconds(message: JsonDict, pace_tps: float) -> float:
    """How long a reply sent whole takes to write: all of its blocks' tokens."""
    return token_seconds(sum(block_chars(b) for b in message["content"]), pace_tps)


def stream_delays(
    events: list[tuple[str, JsonDict]], pace_tps: float, token_delay_s: float
) -> list[float]:
    """Seconds to wait before each event: a delta first waits for its own tokens (the
    model writes them, then they go out), and the event after a delta `token_delay_s`."""
    delays, after_delta = [], False
    for name, data in events:
        wait = token_delay_s if after_delta else 0.0
        if name == "content_block_delta":
            wait += token_seconds(_delta_chars(data["delta"]), pace_tps)
        delays.append(wait)
        after_delta = name == "content_block_delta"
    return delays


def encode_sse(event: str, data: JsonDict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str | None = None) -> JsonDict:
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message or f"Fake {kind}"}}


def retry_headers(fault: StatusFault) -> dict[str, str]:
    headers = {}
    if fault.retry_after_s is not None:
        headers["retry-after"] = f"{fault.retry_after_s:g}"
    if fault.retry_after_ms is not None:
        headers["retry-after-ms"] = str(fault.retry_after_ms)
    return headers
