"""The LLM request: keyword arguments for `anthropic.Anthropic().messages.create`.

Owns the shape of one Messages API request and where its prompt-cache breakpoints go,
plus `cacheable_share`, the measure of how much of one request the previous request left
in the cache. Called by the coordinator's request preparation (`coordinator/prepare.py`)
after `sanitize_history`, `resolve_tools` and `system_prompt`/`turn_reminder`; the
lead's cache report prints `cacheable_share` between consecutive turns.

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

Cache TTL: with `cache_ttl="1h"` the system breakpoints (which cache the tools and the
system prefix together: tools come first in cache order) say `"ttl": "1h"`, so a run
that waits on a person for more than five minutes still reads them; the message
breakpoints keep the default 5 minutes (the API wants longer TTLs before shorter ones).

Extended thinking (`thinking`, the API's own object, passed through): thinking and
`redacted_thinking` blocks are sent exactly as stored, never copied or re-marked, since
the API checks them against their signatures. With thinking on (any type but
`disabled`) no temperature is sent and `tool_choice` stays `auto`, the only values the
API accepts then; a `budget_tokens` that would leave no room for the answer raises
`max_tokens` to the budget plus the configured `max_tokens`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from cmdop_worker.core.catalog import tool_definitions
from cmdop_worker.models import Message, ToolSpec

MAX_CACHE_BREAKPOINTS = 4
CACHE_CONTROL = "cache_control"
EPHEMERAL = {"type": "ephemeral"}
THINKING_BLOCKS = frozenset({"thinking", "redacted_thinking"})

Block = dict[str, Any]
CacheTtl = Literal["5m", "1h"]


def build_request(
    *,
    model: str,
    system: list[dict[str, Any]],
    reminder: str,
    history: Sequence[Message],
    tools: Sequence[ToolSpec],
    temperature: float | None,
    max_tokens: int,
    thinking: Mapping[str, Any] | None = None,
    cache_ttl: CacheTtl = "5m",
) -> dict[str, Any]:
    """Keyword arguments for `messages.create`; `history` is never changed.

    Raises ValueError when `history` has no user message to carry the reminder.
    """
    system_blocks = _capped_system(system, cache_ttl)
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
        "max_tokens": _max_tokens(max_tokens, thinking),
        "system": system_blocks,
        "messages": messages,
    }
    definitions = tool_definitions(tools)
    if definitions:
        request["tools"] = definitions
        # With thinking on, `auto` (or `none`) is all the API accepts.
        request["tool_choice"] = {"type": "auto"}
    if thinking is not None:
        request["thinking"] = dict(thinking)
    if temperature is not None and not thinking_on(thinking):
        # anthropic 2.x dropped the `temperature` argument; the API still accepts it,
        # except with thinking on.
        request["extra_body"] = {"temperature": temperature}
    return request


def thinking_on(thinking: Mapping[str, Any] | None) -> bool:
    """Whether `thinking` asks the model to think (every type but `disabled`)."""
    return thinking is not None and thinking.get("type") != "disabled"


def _max_tokens(max_tokens: int, thinking: Mapping[str, Any] | None) -> int:
    # Thinking tokens count toward max_tokens, and the API wants budget_tokens below it.
    budget = thinking.get("budget_tokens") if thinking is not None else None
    if isinstance(budget, int) and budget >= max_tokens:
        return budget + max_tokens
    return max_tokens


def _capped_system(system: list[dict[str, Any]], cache_ttl: CacheTtl) -> list[Block]:
    blocks = copy.deepcopy(system)
    marked = 0
    for block in blocks:
        if CACHE_CONTROL in block:
            marked += 1
            if marked > MAX_CACHE_BREAKPOINTS:
                del block[CACHE_CONTROL]
            elif cache_ttl != "5m":
                block[CACHE_CONTROL] = {**EPHEMERAL, "ttl": cache_ttl}
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
    through copies (as `build_request` does for the breakpoints). Thinking blocks are
    returned as they are, whatever they carry: the API checks them byte for byte.
    """
    if block.get("type") in THINKING_BLOCKS:
        return block
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
