"""History sanitation: turn any stored conversation into one the Messages API accepts.

Owns the validity rules for a conversation sent to Anthropic and the repair policy.
Called by the coordinator's request preparation (`coordinator/prepare.py`) on every turn
before `build_request`, and by its consistency checks through `is_valid_history`.

Rules guaranteed on the output:

- roles alternate, starting with "user"; no message has empty content;
- every assistant `tool_use` id is unique and answered by a `tool_result` in the
  immediately following user message; every `tool_result` answers a `tool_use` of the
  immediately preceding assistant message, once; `tool_result` blocks come first;
- blocks sit in a role that may carry them (`tool_use` only from the assistant,
  `tool_result` only from the user) and text blocks are not blank.

Repair policy, and why:

- An orphan tool call (no matching result, e.g. a machine died or the run was
  cancelled mid-turn) gets a synthesised error result rather than being dropped.
  Dropping it would also have to drop or rewrite the assistant text around it, and the
  model would lose the fact that it already tried that call; an explicit
  "interrupted" result keeps the record honest and lets the model decide to retry.
- A result without a call is dropped: there is nothing to attach it to.
- Duplicate tool_use ids keep their first occurrence; later duplicates are dropped.
- Consecutive messages of one role are merged (a string becomes a text block).
- Empty messages and blank text blocks are removed.
- A conversation that starts with the assistant gets a placeholder user message
  ("(conversation continues)") in front rather than losing that message, for the
  same reason orphans are kept: what the model said stays visible.

`sanitize_history` is deterministic, idempotent, leaves a valid history unchanged and
never mutates its input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cmdop_worker.models import Message

Role = Literal["user", "assistant"]
Block = dict[str, Any]

PLACEHOLDER_USER_TEXT = "(conversation continues)"
INTERRUPTED_RESULT_TEXT = "interrupted: no result was recorded for this call"

_ROLE_FORBIDS = {"user": "tool_use", "assistant": "tool_result"}


@dataclass
class _Turn:
    """A message being repaired; `content` stays a string until something forces blocks."""

    role: Role
    content: str | list[Block]


def interrupted_result(tool_use_id: str) -> Block:
    """The result synthesised for a tool call that has none."""
    return {
        "type": "tool_result",
        "tool_use_id": tool_use_id,
        "is_error": True,
        "content": INTERRUPTED_RESULT_TEXT,
    }


def sanitize_history(messages: Sequence[Message]) -> list[Message]:
    """A copy of `messages` repaired to satisfy every rule in the module docstring."""
    seen_ids: set[str] = set()
    turns = [_clean(m, seen_ids) for m in messages]
    merged = _merge_roles([t for t in turns if not _is_empty(t.content)])
    paired = _pair_results(merged)
    return [Message(role=t.role, content=t.content) for t in paired]


def _clean(message: Message, seen_ids: set[str]) -> _Turn:
    # Blocks are shared with the input, not copied: nothing in this module mutates a
    # block (repairs build new lists and new blocks), and the `Message` built from each
    # repaired turn copies the content list and every block dict when it validates.
    if isinstance(message.content, str):
        return _Turn(message.role, message.content)
    kept = [b for b in message.content if _block_fits(b, message.role, seen_ids)]
    return _Turn(message.role, kept)


def _block_fits(block: Block, role: Role, seen_ids: set[str]) -> bool:
    kind = block.get("type")
    if not isinstance(kind, str) or kind == _ROLE_FORBIDS[role]:
        return False
    if kind == "text":
        text = block.get("text")
        return isinstance(text, str) and bool(text.strip())
    if kind == "tool_result":
        return _is_id(block.get("tool_use_id"))
    if kind == "tool_use":
        return _tool_use_fits(block, seen_ids)
    return True


def _tool_use_fits(block: Block, seen_ids: set[str]) -> bool:
    block_id = block.get("id")
    well_formed = isinstance(block.get("name"), str) and isinstance(block.get("input"), dict)
    if not well_formed or not isinstance(block_id, str) or not block_id or block_id in seen_ids:
        return False
    seen_ids.add(block_id)
    return True


def _is_id(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _is_empty(content: str | list[Block]) -> bool:
    return not content.strip() if isinstance(content, str) else not content


def _blocks(content: str | list[Block]) -> list[Block]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _merge_roles(turns: list[_Turn]) -> list[_Turn]:
    merged: list[_Turn] = []
    for turn in turns:
        if merged and merged[-1].role == turn.role:
            merged[-1].content = _blocks(merged[-1].content) + _blocks(turn.content)
        else:
            merged.append(_Turn(turn.role, turn.content))
    return merged


def _pair_results(turns: list[_Turn]) -> list[_Turn]:
    """Match results to calls; a user message left empty makes its neighbours merge."""
    out: list[_Turn] = []
    for turn in turns:
        if turn.role == "user":
            calls = _tool_use_ids(out[-1]) if out else []
            content = _answer(turn.content, calls)
            if not _is_empty(content):
                out.append(_Turn("user", content))
        elif out and out[-1].role == "assistant":
            # Only reachable when the user message between them held nothing but stray
            # results, so the earlier assistant message has no calls left to answer.
            out[-1].content = _blocks(out[-1].content) + _blocks(turn.content)
        else:
            if not out:
                out.append(_Turn("user", PLACEHOLDER_USER_TEXT))
            out.append(turn)
    if out and out[-1].role == "assistant" and _tool_use_ids(out[-1]):
        out.append(_Turn("user", _answer([], _tool_use_ids(out[-1]))))
    return out


def _tool_use_ids(turn: _Turn) -> list[str]:
    if turn.role != "assistant" or isinstance(turn.content, str):
        return []
    return [b["id"] for b in turn.content if b.get("type") == "tool_use"]


def _answer(content: str | list[Block], calls: list[str]) -> str | list[Block]:
    """User content with exactly one result per call, results first, strays dropped."""
    if not calls and (isinstance(content, str) or not _has_results(content)):
        return content
    pending = list(calls)
    results: list[Block] = []
    others: list[Block] = []
    for block in _blocks(content):
        if block.get("type") != "tool_result":
            others.append(block)
        elif block["tool_use_id"] in pending:
            pending.remove(block["tool_use_id"])
            results.append(block)
    results.extend(interrupted_result(call_id) for call_id in pending)
    return results + others


def _has_results(blocks: list[Block]) -> bool:
    return any(b.get("type") == "tool_result" for b in blocks)


def is_valid_history(messages: Sequence[Message]) -> list[str]:
    """Every rule violation in `messages`, as readable strings; empty when valid."""
    problems: list[str] = []
    seen_ids: set[str] = set()
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        problems.extend(_role_problems(messages, index, where))
        if _is_empty(message.content):
            problems.append(f"{where}: empty content")
        if isinstance(message.content, list):
            problems.extend(_block_problems(message, where, seen_ids))
        previous = messages[index - 1] if index else None
        following = messages[index + 1] if index + 1 < len(messages) else None
        problems.extend(_pairing_problems(previous, message, following, where))
    return problems


def _role_problems(messages: Sequence[Message], index: int, where: str) -> list[str]:
    role = messages[index].role
    if index == 0 and role != "user":
        return [f"{where}: the first message must come from the user"]
    if index > 0 and messages[index - 1].role == role:
        return [f"{where}: two {role} messages in a row"]
    return []


def _block_problems(message: Message, where: str, seen_ids: set[str]) -> list[str]:
    problems: list[str] = []
    seen_other = False
    for position, block in enumerate(_blocks(message.content)):
        at = f"{where}.content[{position}]"
        kind = block.get("type")
        if kind == "tool_use" and block.get("id") in seen_ids:
            problems.append(f"{at}: duplicate tool_use id {block.get('id')!r}")
        elif not _block_fits(block, message.role, seen_ids):
            problems.append(f"{at}: {kind!r} block is malformed or not allowed here")
        if kind == "tool_result" and seen_other:
            problems.append(f"{at}: tool_result after a non-result block")
        seen_other = seen_other or kind != "tool_result"
    return problems


def _pairing_problems(
    previous: Message | None, message: Message, following: Message | None, where: str
) -> list[str]:
    if message.role == "assistant":
        answered = _result_ids(following) if following and following.role == "user" else []
        return [
            f"{where}: tool_use {call!r} has no tool_result in the next message"
            for call in _message_call_ids(message)
            if call not in answered
        ]
    calls = _message_call_ids(previous) if previous and previous.role == "assistant" else []
    problems: list[str] = []
    results = _result_ids(message)
    for call in dict.fromkeys(results):
        if call not in calls:
            problems.append(f"{where}: tool_result {call!r} answers no call just before it")
        if results.count(call) > 1:
            problems.append(f"{where}: tool_result {call!r} appears more than once")
    return problems


def _message_call_ids(message: Message) -> list[str]:
    return [
        str(b.get("id"))
        for b in _blocks(message.content)
        if b.get("type") == "tool_use" and message.role == "assistant"
    ]


def _result_ids(message: Message) -> list[str]:
    return [
        str(b.get("tool_use_id"))
        for b in _blocks(message.content)
        if b.get("type") == "tool_result"
    ]
