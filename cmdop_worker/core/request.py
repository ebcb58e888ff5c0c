"""The LLM request: keyword arguments for `anthropic.Anthropic().messages.create`.

Owns the shape of one Messages API request and where its prompt-cache breakpoints go,
plus `cacheable_share`, the measure of how much of one request the previous request
left in the cache. Called by the coordinator's turn task (`coordinator/turn.py`) after
`sanitize_history`, `resolve_tools` and `system_prompt`/`turn_reminder`; the lead's
cache report prints `cacheable_share` between consecutive turns.

Breakpoints (`cache_control: {"type": "ephemeral"}`, at most 4 per request, which is
the API's limit):

1. the system prefix's first block, set by `system_prompt` and counted here;
2. the last block of the last user message's own content (the reminder comes after);
3. the last block of the user message before that one, which is exactly where the
   previous turn's request put breakpoint 2, so this turn reads that cache entry even
   when the turn added more blocks than the API's lookback window covers.

The per-turn reminder is appended as an extra text block after the last user message's
content: it changes every turn, so it must sit after every breakpoint, and it is never
written back into history.

Every message's content is sent as a list of blocks, even when history holds a string:
a message must serialise the same whether or not a breakpoint sits on it this turn,
otherwise the bytes before the previous breakpoint would change and miss the cache.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from cmdop_worker.core.catalog import tool_definitions
from cmdop_worker.models import Message, ToolSpec

MAX_CACHE_BREAKPOINTS = 4
CACHE_CONTROL = "cache_control"
EPHEMERAL = {"type": "ephemeral"}

Block = dict[str, Any]


def build_request(
    *,
    model: str,
    system: list[dict[str, Any]],
    reminder: str,
    history: Sequence[Message],
    tools: Sequence[ToolSpec],
    temperature: float | None,
    max_tokens: int,
) -> dict[str, Any]:
    """Keyword arguments for `messages.create`; `history` is never changed.

    Raises ValueError when `history` has no user message to carry the reminder.
    """
    system_blocks = _capped_system(system)
    messages = [_plain_message(m) for m in history]
    last_user = _last_user_index(messages, len(messages))
    if last_user is None:
        raise ValueError("history has no user message")
    budget = MAX_CACHE_BREAKPOINTS - sum(CACHE_CONTROL in b for b in system_blocks)
    for index in _breakpoint_messages(messages, last_user)[: max(budget, 0)]:
        # A copy: unmarked blocks are shared with `history`, which must not change.
        content = messages[index]["content"]
        content[-1] = {**content[-1], CACHE_CONTROL: dict(EPHEMERAL)}
    if reminder.strip():
        messages[last_user]["content"].append({"type": "text", "text": reminder})
    request: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "system": system_blocks,
        "messages": messages,
    }
    definitions = tool_definitions(tools)
    if definitions:
        request["tools"] = definitions
        request["tool_choice"] = {"type": "auto"}
    if temperature is not None:
        # anthropic 2.x dropped the `temperature` argument; the API still accepts it.
        request["extra_body"] = {"temperature": temperature}
    return request


def _capped_system(system: list[dict[str, Any]]) -> list[Block]:
    blocks = copy.deepcopy(system)
    marked = 0
    for block in blocks:
        if CACHE_CONTROL in block:
            marked += 1
            if marked > MAX_CACHE_BREAKPOINTS:
                del block[CACHE_CONTROL]
    return blocks


def _plain_message(message: Message) -> dict[str, Any]:
    """A dict copy of `message` with list content and no stray cache markers."""
    if isinstance(message.content, str):
        blocks: list[Block] = [{"type": "text", "text": message.content}]
    else:
        blocks = [_unmarked(b) for b in message.content]
    return {"role": message.role, "content": blocks}


def _unmarked(block: Block) -> Block:
    """`block` itself, or a copy without the markers it carries; never a changed `block`.

    A marker stored in history (a client may send one) would count against the API's
    limit of 4; markers are placed here only. Tool inputs are left alone. Blocks
    without markers are shared with history, so the request must not be mutated except
    through copies (as `build_request` does for the breakpoints).
    """
    nested = block.get("content") if block.get("type") == "tool_result" else None
    inner = nested if isinstance(nested, list) and any(map(_is_marked, nested)) else None
    if CACHE_CONTROL not in block and inner is None:
        return block
    clean = {key: value for key, value in block.items() if key != CACHE_CONTROL}
    if inner is not None:
        clean["content"] = [_without_marker(item) for item in inner]
    return clean


def _is_marked(item: Any) -> bool:
    return isinstance(item, dict) and CACHE_CONTROL in item


def _without_marker(item: Any) -> Any:
    if not _is_marked(item):
        return item
    return {key: value for key, value in item.items() if key != CACHE_CONTROL}


def _last_user_index(messages: list[dict[str, Any]], before: int) -> int | None:
    for index in range(before - 1, -1, -1):
        if messages[index]["role"] == "user":
            return index
    return None


def _breakpoint_messages(messages: list[dict[str, Any]], last_user: int) -> list[int]:
    """Messages whose last block gets a breakpoint, most valuable first."""
    chosen = [last_user]
    previous_user = _last_user_index(messages, last_user)
    if previous_user is not None:
        chosen.append(previous_user)
    return [i for i in chosen if messages[i]["content"]]


def cache_breakpoint_count(request: dict[str, Any]) -> int:
    """How many blocks of `request` (tools, system, messages) carry `cache_control`."""
    return sum(marked for _, marked in _segments(request))


def cache_prefix(request: dict[str, Any]) -> bytes:
    """The canonical bytes of `request` up to and including its last breakpoint."""
    segments = _segments(request)
    ends = [i for i, (_, marked) in enumerate(segments) if marked]
    return _joined(segments[: ends[-1] + 1]) if ends else b""


def request_bytes(request: dict[str, Any]) -> bytes:
    """The canonical bytes of the whole of `request`, in cache order (tools, system,
    messages), markers stripped: what `cache_prefix` is a prefix of."""
    return _joined(_segments(request))


def cacheable_share(prev: dict[str, Any], cur: dict[str, Any]) -> float:
    """Share of `cur`'s canonical bytes that `prev` left in the prompt cache.

    The cache matches whole prefixes ending at a breakpoint, so this is the longest
    prefix of `prev` ending at one of its breakpoints that `cur` starts with, over the
    length of `cur`. Serialisation is canonical (sorted keys) with `cache_control`
    stripped: the markers move every turn and are not part of the cached content.
    """
    current = request_bytes(cur)
    if not current:
        return 0.0
    previous = _segments(prev)
    best = 0
    for index, (_, marked) in enumerate(previous):
        prefix = _joined(previous[: index + 1])
        if marked and current.startswith(prefix):
            best = len(prefix)
    return best / len(current)


def _segments(request: dict[str, Any]) -> list[tuple[str, bool]]:
    """The request in cache order (tools, system, messages) as canonical pieces."""
    pieces: list[Any] = list(request.get("tools", []))
    system = request.get("system", [])
    pieces.extend([{"type": "text", "text": system}] if isinstance(system, str) else system)
    for message in request.get("messages", []):
        pieces.append({"role": message["role"]})
        content = message["content"]
        pieces.extend([{"type": "text", "text": content}] if isinstance(content, str) else content)
    return [(_canonical(p), isinstance(p, dict) and CACHE_CONTROL in p) for p in pieces]


def _canonical(piece: Any) -> str:
    if isinstance(piece, dict):
        piece = {k: v for k, v in piece.items() if k != CACHE_CONTROL}
    return json.dumps(piece, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _joined(segments: list[tuple[str, bool]]) -> bytes:
    return "".join(text + "\n" for text, _ in segments).encode()
