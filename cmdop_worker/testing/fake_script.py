"""Pure logic of the fake Anthropic Messages API: scripts, faults, usage and events.

Owns the script and fault formats, which script and turn answer a request, the
rendering of a turn into content blocks, the prompt-cache approximation and the SSE
event sequence. Called by `fake_anthropic` (the HTTP shell), which does all I/O,
sleeping and id generation: nothing here reads a clock, a socket or a random source.

Script (a bare list of turns is accepted for `{"turns": [...]}`, and a bare list of
blocks for `{"content": [...]}`)::

    {"turns": [{"content": [BLOCK, ...], "latency_ms": 0, "fault": FAULT | null}, ...],
     "latency_ms": 0, "token_delay_ms": 0}
    BLOCK = {"type": "text", "text": str} | {"type": "thinking", "thinking": str}
          | {"type": "tool_use", "name": str, "input": {...}, "id": str?}

Text may hold `{{result:N}}`, `{{results}}` and `{{last_user_text}}`.

Usage: a request is flattened into segments (each tool, each system block, each
message content block, in that order, `cache_control` removed) and every prefix is
hashed (per model). Tokens are characters of the JSON list of segments // 4. A prefix ending on a
block with `cache_control` is written to the cache; a later request reads the longest
remembered prefix that ends at or before its own last breakpoint. No minimum length,
no TTL, no 20-block lookback limit.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

MARKER = re.compile(r"\[\[script:([A-Za-z0-9_.-]+)\]\]")
PLACEHOLDER = re.compile(r"\{\{(result:(\d+)|results|last_user_text)\}\}")
WORDS_PER_DELTA = 3
JsonDict = dict[str, Any]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TextSpec(_Frozen):
    type: Literal["text"]
    text: str


class ThinkingSpec(_Frozen):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseSpec(_Frozen):
    type: Literal["tool_use"]
    name: str
    input: JsonDict = Field(default_factory=dict)
    id: str | None = None


BlockSpec = Annotated[TextSpec | ThinkingSpec | ToolUseSpec, Field(discriminator="type")]


class _Fault(_Frozen):
    times: int = Field(default=1, ge=1)  # how many requests the fault applies to


class StatusFault(_Fault):
    """An HTTP error with an Anthropic-shaped body and optional retry-after headers."""

    kind: Literal["status"] = "status"
    status: int = Field(ge=400, le=599)
    retry_after_s: float | None = None
    retry_after_ms: int | None = None
    message: str | None = None


class StallFault(_Fault):
    """Sleep before the response, or in a stream after `after_events` events."""

    kind: Literal["stall"]
    seconds: float = Field(ge=0)
    after_events: int | None = Field(default=None, ge=0)


class ErrorEventFault(_Fault):
    kind: Literal["error_event"]
    after_events: int = Field(default=0, ge=0)


class TruncateFault(_Fault):
    kind: Literal["truncate"]
    after_events: int = Field(default=0, ge=0)


class ResetFault(_Fault):
    kind: Literal["reset"]


class MalformedFault(_Fault):
    kind: Literal["malformed"]


def _fault_tag(value: Any) -> str:
    if isinstance(value, Mapping):
        return str(value.get("kind", "status"))
    return str(getattr(value, "kind", "status"))


Fault = Annotated[
    Annotated[StatusFault, Tag("status")]
    | Annotated[StallFault, Tag("stall")]
    | Annotated[ErrorEventFault, Tag("error_event")]
    | Annotated[TruncateFault, Tag("truncate")]
    | Annotated[ResetFault, Tag("reset")]
    | Annotated[MalformedFault, Tag("malformed")],
    Discriminator(_fault_tag),
]
_FAULTS: TypeAdapter[list[Fault]] = TypeAdapter(list[Fault])


def parse_faults(payload: Any) -> list[Fault]:
    """One fault or a list of them, as JSON values or models."""
    items = payload if isinstance(payload, list) else [payload]
    return _FAULTS.validate_python(items)


class Turn(_Frozen):
    content: list[BlockSpec] = Field(min_length=1)
    latency_ms: float = Field(default=0, ge=0)
    fault: Fault | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, value: Any) -> Any:
        return {"content": value} if isinstance(value, list) else value


class Script(_Frozen):
    turns: list[Turn] = Field(min_length=1)
    latency_ms: float = Field(default=0, ge=0)
    token_delay_ms: float = Field(default=0, ge=0)
    # A request for one of these models gets this text instead of the script's turn
    # (e.g. a small model used as an intent classifier).
    model_answers: dict[str, str] = Field(default_factory=dict)

    def turn_for(self, index: int, model: str) -> Turn:
        if model in self.model_answers:
            return Turn(content=[TextSpec(type="text", text=self.model_answers[model])])
        return self.turn(index)

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, value: Any) -> Any:
        return {"turns": value} if isinstance(value, list) else value

    def turn(self, index: int) -> Turn:
        """The turn for `index`; past the end the last turn repeats."""
        return self.turns[min(index, len(self.turns) - 1)]


DEFAULT_SCRIPT = Script(
    turns=[Turn(content=[TextSpec(type="text", text="You said: {{last_user_text}}")])]
)
DEMO_SCRIPT = Script.model_validate(
    [
        [
            {"type": "text", "text": "Let me check both machines."},
            {
                "type": "tool_use",
                "name": "execute_command",
                "input": {"machine": "alpha", "command": "uname -n && uptime"},
            },
            {
                "type": "tool_use",
                "name": "execute_command",
                "input": {"machine": "beta", "command": "uname -n && df -h / | tail -1"},
            },
        ],
        [{"type": "text", "text": "alpha: {{result:0}} / beta: {{result:1}}"}],
    ]
)
BUILTIN_SCRIPTS: Mapping[str, Script] = {"default": DEFAULT_SCRIPT, "demo": DEMO_SCRIPT}


# --- reading a request -------------------------------------------------------------


def _messages(body: Mapping[str, Any]) -> list[JsonDict]:
    messages = body.get("messages")
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


def _block_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(b.get("text", ""))
            for b in content
            if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


def script_name(body: Mapping[str, Any], default: str) -> str:
    """The `[[script:NAME]]` marker of the first user message, else `default`."""
    first_user = next((m for m in _messages(body) if m.get("role") == "user"), None)
    found = MARKER.search(_block_text(first_user.get("content"))) if first_user else None
    return found.group(1) if found else default


def turn_index(body: Mapping[str, Any]) -> int:
    """How many assistant messages the request carries: runs are stateless and independent."""
    return sum(1 for m in _messages(body) if m.get("role") == "assistant")


def _last_user(body: Mapping[str, Any]) -> JsonDict:
    return next((m for m in reversed(_messages(body)) if m.get("role") == "user"), {})


def tool_results(body: Mapping[str, Any]) -> list[str]:
    """The text of each `tool_result` block of the last user message, in order."""
    content = _last_user(body).get("content")
    blocks = content if isinstance(content, list) else []
    return [
        _block_text(b.get("content"))
        for b in blocks
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]


def substitute(text: str, body: Mapping[str, Any]) -> str:
    results = tool_results(body)

    def replace(match: re.Match[str]) -> str:
        if match.group(2) is not None:
            n = int(match.group(2))
            return results[n] if n < len(results) else f"<no result {n}>"
        if match.group(1) == "results":
            return "; ".join(results)
        return _block_text(_last_user(body).get("content"))

    return PLACEHOLDER.sub(replace, text)


def render_blocks(
    turn: Turn, body: Mapping[str, Any], new_tool_id: Callable[[], str]
) -> list[JsonDict]:
    """The turn's content blocks as the API returns them."""
    rendered: list[JsonDict] = []
    for spec in turn.content:
        if isinstance(spec, TextSpec):
            rendered.append(
                {"type": "text", "text": substitute(spec.text, body), "citations": None}
            )
        elif isinstance(spec, ThinkingSpec):
            signature = (
                spec.signature or "fake-" + hashlib.sha256(spec.thinking.encode()).hexdigest()[:32]
            )
            rendered.append({"type": "thinking", "thinking": spec.thinking, "signature": signature})
        else:
            tool_id = spec.id or new_tool_id()
            rendered.append(
                {"type": "tool_use", "id": tool_id, "name": spec.name, "input": spec.input}
            )
    return rendered


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
    for message in _messages(body):
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
    total = (points[-1].chars if points else 2) // 4
    last_bp = max((i for i, p in enumerate(points) if p.breakpoint), default=-1)
    eligible = points[: last_bp + 1]
    read_chars = max((p.chars for p in eligible if p.key in cached), default=0)
    new = [p for p in eligible if p.breakpoint and p.chars > read_chars and p.key not in cached]
    write_chars = max((p.chars for p in new), default=read_chars)
    read, creation = read_chars // 4, write_chars // 4 - read_chars // 4
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
            "output_tokens": max(1, len(_canonical(blocks)) // 4),
            "cache_creation_input_tokens": usage.cache_creation_input_tokens,
            "cache_read_input_tokens": usage.cache_read_input_tokens,
        },
    }


def text_chunks(text: str, words: int = WORDS_PER_DELTA) -> list[str]:
    """`text` in pieces of a few words each, whitespace kept, so "".join() restores it."""
    pieces = re.findall(r"\s*\S+\s*", text) or [text]
    return ["".join(pieces[i : i + words]) for i in range(0, len(pieces), words)]


def json_chunks(value: Any) -> list[str]:
    """The JSON of `value` in 2 to 3 partial pieces, as `input_json_delta` sends it."""
    text = json.dumps(value)
    step = max(1, -(-len(text) // 3))
    return [text[i : i + step] for i in range(0, len(text), step)]


def _block_events(index: int, block: JsonDict) -> Iterator[tuple[str, JsonDict]]:
    kind = block["type"]
    if kind == "text":
        start: JsonDict = {"type": "text", "text": "", "citations": None}
        deltas = [{"type": "text_delta", "text": t} for t in text_chunks(block["text"])]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": t} for t in text_chunks(block["thinking"])]
        deltas.append({"type": "signature_delta", "signature": block["signature"]})
    else:
        start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        deltas = [
            {"type": "input_json_delta", "partial_json": p} for p in json_chunks(block["input"])
        ]
    yield (
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": start},
    )
    for delta in deltas:
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    yield "content_block_stop", {"type": "content_block_stop", "index": index}


def sse_events(message: JsonDict) -> list[tuple[str, JsonDict]]:
    """The event sequence that streams `message`, ping included, as Anthropic sends it."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    events: list[tuple[str, JsonDict]] = [
        ("message_start", {"type": "message_start", "message": start}),
        ("ping", {"type": "ping"}),
    ]
    for index, block in enumerate(message["content"]):
        events.extend(_block_events(index, block))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


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
