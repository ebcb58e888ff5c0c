"""Clearing old tool results, so a long run or thread stays within its context budget.

Owns when a history is cleared and what a cleared tool result says. Called by the
coordinator's request preparation (`coordinator/prepare.py`) before every request is
built; the cleared history is what the turn stores, so a thread hands it on to its next
run.

Why our own clearing and not the API's context editing (`clear_tool_uses`, a beta of
`client.beta.messages`): our stored history is the source of truth we sanitise, cache
and recover from, and the server-side edit would leave it growing without bound in
Redis and in every request body; a pure function over that history is deterministic, so
a turn re-run after a crash clears exactly what the first attempt cleared.

Policy:

- The size of a history is estimated as its canonical JSON's characters / 4
  (`history_tokens`), which is roughly what the Messages API counts for English text
  and JSON. It is an estimate: set `CMDOP_CONTEXT_MAX_TOKENS` with headroom below the
  model's window.
- Nothing changes while the estimate is at or under `max_tokens`: a history that only
  grows keeps every byte, so the prompt cache's prefix stays identical between clears.
- Past it, the contents of the oldest tool results are replaced by `CLEARED_TEXT`,
  oldest first, until the estimate is at most `target_share` of `max_tokens` (half by
  default): one clear buys many turns before the next, each clear costing one cache
  write of the whole prefix.
- The results of the last user message (the ones the model is about to read) are never
  cleared, nor results already cleared or too small to gain anything. Each result
  keeps its block, its `tool_use_id` and its `is_error`, so tool_use/tool_result pairs
  stay valid; thinking blocks, tool inputs and text are never altered.
- When clearing every eligible result is not enough (what a long session keeps, its
  calls, texts and thinking, grows too), the oldest whole exchanges after the first
  user message (the task) are removed, each an assistant message and the user message
  answering it, until the estimate is under the target; the first user message gets
  `DROPPED_TEXT` appended once. The cut falls before an assistant message, so roles
  still alternate and every call still has its result; the last assistant message and
  the user message after it are always kept. A history of one huge message is left to
  the API's own limit.

`clear_old_results` never mutates its input and is idempotent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cmdop_worker.models import Message

CHARS_PER_TOKEN = 4
DEFAULT_TARGET_SHARE = 0.5
CLEARED_TEXT = (
    "[cleared: an older tool result, removed to keep the conversation within its "
    "context limit; run the tool again if you need it]"
)
DROPPED_TEXT = (
    "[earlier turns of this conversation were removed to keep it within its context "
    "limit; what follows is the most recent part]"
)


@dataclass(frozen=True)
class Clearing:
    """A history after `clear_old_results`: how many results it cleared and how many
    messages it removed."""

    history: list[Message]
    cleared: int
    tokens_before: int
    tokens_after: int
    dropped: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.cleared or self.dropped)


def history_tokens(history: Sequence[Message]) -> int:
    """The estimated input tokens of `history` (see the module docstring)."""
    return sum(_chars(m.model_dump(mode="json")) for m in history) // CHARS_PER_TOKEN


def clear_old_results(
    history: Sequence[Message],
    *,
    max_tokens: int,
    target_share: float = DEFAULT_TARGET_SHARE,
) -> Clearing:
    """`history` with its oldest tool results cleared when it is over `max_tokens`."""
    before = history_tokens(history)
    if before <= max_tokens:
        return Clearing(list(history), 0, before, before)
    excess_chars = (before - int(max_tokens * target_share)) * CHARS_PER_TOKEN
    out = list(history)
    cleared = 0
    for index in range(_last_user_index(history)):
        if excess_chars <= 0:
            break
        message = history[index]
        if message.role != "user" or isinstance(message.content, str):
            continue
        content, saved, count = _cleared_content(message.content, excess_chars)
        if count:
            out[index] = Message(role="user", content=content)
            excess_chars -= saved
            cleared += count
    target = int(max_tokens * target_share)
    after = history_tokens(out) if cleared else before
    if after <= target:
        return Clearing(out, cleared, before, after)
    out, dropped = _dropped_exchanges(out, (after - target + 1) * CHARS_PER_TOKEN)
    return Clearing(out, cleared, before, history_tokens(out), dropped)


def _dropped_exchanges(history: list[Message], excess_chars: int) -> tuple[list[Message], int]:
    """`history` without its oldest exchanges, `excess_chars` of them or as many as may go."""
    if len(history) < 4 or history[0].role != "user":
        return history, 0
    first = _with_note(history[0])
    excess_chars += _chars(first.model_dump(mode="json")) - _chars(
        history[0].model_dump(mode="json")
    )
    cut, saved = 1, 0
    # A cut at `index` keeps history[index:], which must start with an assistant message;
    # the last assistant message and the user message after it always stay.
    for index in range(2, len(history) - 1):
        saved += _chars(history[index - 1].model_dump(mode="json"))
        if history[index].role == "assistant" and history[index - 1].role == "user":
            cut = index
            if saved >= excess_chars:
                break
    if cut == 1:
        return history, 0
    return [first, *history[cut:]], cut - 1


def _with_note(first: Message) -> Message:
    blocks = (
        [{"type": "text", "text": first.content}]
        if isinstance(first.content, str)
        else first.content
    )
    if any(b.get("type") == "text" and b.get("text") == DROPPED_TEXT for b in blocks):
        return first
    return Message(role="user", content=[*blocks, {"type": "text", "text": DROPPED_TEXT}])


def _cleared_content(
    blocks: list[dict[str, Any]], excess_chars: int
) -> tuple[list[dict[str, Any]], int, int]:
    """The blocks with results cleared until `excess_chars` are saved; chars saved, count."""
    out: list[dict[str, Any]] = []
    saved = count = 0
    for block in blocks:
        if saved < excess_chars and _clearable(block):
            replacement = {**block, "content": CLEARED_TEXT}
            gain = _chars(block) - _chars(replacement)
            if gain > 0:
                out.append(replacement)
                saved += gain
                count += 1
                continue
        out.append(block)
    return out, saved, count


def _clearable(block: dict[str, Any]) -> bool:
    return block.get("type") == "tool_result" and block.get("content") != CLEARED_TEXT


def _last_user_index(history: Sequence[Message]) -> int:
    for index in range(len(history) - 1, -1, -1):
        if history[index].role == "user":
            return index
    return 0


def _chars(value: Any) -> int:
    return len(json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")))
