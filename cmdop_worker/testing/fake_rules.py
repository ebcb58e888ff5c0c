"""Request rules the fake Anthropic server enforces as the API does: thinking and caching.

Owns the fake's thinking signatures and the checks on a request body that the real
Messages API answers with `400 invalid_request_error`. Called by `fake_script` (which
signs the thinking it renders) and by `fake_state` (which refuses a request that breaks
a rule before anything else happens). Pure: no I/O, no clock, no randomness.

Signatures: a thinking block's `signature` is a keyed hash (HMAC-SHA256) of its
thinking text; a `redacted_thinking` block's `data` is an opaque payload followed by a
keyed hash of it. A later request must send both back unchanged: a changed text,
signature or payload, a missing signature or an extra field (`cache_control` included:
the API refuses markers on thinking blocks) is refused.

Rules checked, with the API's reason:

- every thinking and redacted_thinking block of an assistant message is as issued;
- with thinking on (`thinking.type` other than `disabled`): no `temperature` other
  than 1, `tool_choice` only `auto` or `none`; with `enabled`: `budget_tokens` at
  least 1024 and below `max_tokens`, and an assistant message answered by tool results
  in the last user message starts with a thinking or redacted_thinking block;
- every `cache_control` is `{"type": "ephemeral"}` with an optional `ttl` of `5m` or
  `1h`, and no `1h` breakpoint comes after a `5m` one (tools, system, messages).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator, Mapping
from typing import Any

SIGNING_KEY = b"cmdop-fake-anthropic-thinking"
_THINKING_KEYS = {
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
_TTLS = ("5m", "1h")


def sign_thinking(thinking: str) -> str:
    """The signature the fake issues for a thinking block of this text."""
    return hmac.new(SIGNING_KEY, thinking.encode(), hashlib.sha256).hexdigest()


def redacted_data(payload: str) -> str:
    """The opaque `data` of a redacted_thinking block carrying `payload`."""
    mac = hmac.new(SIGNING_KEY, payload.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{payload}.{mac}"


def request_problem(body: Mapping[str, Any]) -> str | None:
    """Why the API would refuse `body`, as its error message says; None when it would not."""
    for check in (_thinking_blocks_problem, _thinking_params_problem, _cache_control_problem):
        problem = check(body)
        if problem is not None:
            return problem
    return None


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


def _blocks(message: Mapping[str, Any]) -> list[Any]:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _thinking_blocks_problem(body: Mapping[str, Any]) -> str | None:
    for m, message in enumerate(_messages(body)):
        for b, block in enumerate(_blocks(message)):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _THINKING_KEYS:
                continue
            where = f"messages.{m}.content.{b}"
            if message.get("role") != "assistant":
                return f"{where}: {kind} blocks may only appear in assistant messages"
            extra = set(block) - _THINKING_KEYS[kind]
            if extra:
                return f"{where}.{kind}.{sorted(extra)[0]}: Extra inputs are not permitted"
            if not _as_issued(block):
                return f"{where}: Invalid `signature` in `{kind}` block"
    return None


def _as_issued(block: Mapping[str, Any]) -> bool:
    if block["type"] == "thinking":
        text, signature = block.get("thinking"), block.get("signature")
        if not isinstance(text, str) or not isinstance(signature, str):
            return False
        return hmac.compare_digest(signature, sign_thinking(text))
    data = block.get("data")
    if not isinstance(data, str) or "." not in data:
        return False
    return hmac.compare_digest(data, redacted_data(data.rsplit(".", 1)[0]))


def _thinking_params_problem(body: Mapping[str, Any]) -> str | None:
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") == "disabled":
        return None
    temperature = body.get("temperature")
    if temperature is not None and temperature != 1:
        return "`temperature` may only be set to 1 when thinking is enabled"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in ("auto", "none"):
        return "Thinking may not be enabled when tool_choice forces tool use."
    if thinking.get("type") != "enabled":
        return None
    budget, max_tokens = thinking.get("budget_tokens"), body.get("max_tokens")
    if not isinstance(budget, int) or budget < 1024:
        return "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
    if isinstance(max_tokens, int) and budget >= max_tokens:
        return "`max_tokens` must be greater than `thinking.budget_tokens`"
    return _tool_loop_problem(body)


def _tool_loop_problem(body: Mapping[str, Any]) -> str | None:
    messages = _messages(body)
    if len(messages) < 2 or messages[-1].get("role") != "user":
        return None
    answered = any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in _blocks(messages[-1])
    )
    previous = messages[-2]
    first = next(iter(_blocks(previous)), None)
    if not answered or previous.get("role") != "assistant":
        return None
    if isinstance(first, dict) and first.get("type") in _THINKING_KEYS:
        return None
    kind = first.get("type") if isinstance(first, dict) else "text"
    return (
        f"messages.{len(messages) - 2}.content.0.type: Expected `thinking` or "
        f"`redacted_thinking`, but found `{kind}`. When `thinking` is enabled, a final "
        "`assistant` message must start with a thinking block."
    )


def _marked(body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each `cache_control` of the request, where it sits, in cache order."""
    tools = body.get("tools")
    system = body.get("system")
    pieces: list[tuple[str, Any]] = [
        *((f"tools.{i}", t) for i, t in enumerate(tools if isinstance(tools, list) else [])),
        *((f"system.{i}", s) for i, s in enumerate(system if isinstance(system, list) else [])),
    ]
    for m, message in enumerate(_messages(body)):
        for b, block in enumerate(_blocks(message)):
            nested = block.get("content") if isinstance(block, dict) else None
            for n, item in enumerate(nested if isinstance(nested, list) else []):
                pieces.append((f"messages.{m}.content.{b}.content.{n}", item))
            pieces.append((f"messages.{m}.content.{b}", block))
    for where, piece in pieces:
        if isinstance(piece, dict) and "cache_control" in piece:
            yield where, piece["cache_control"]


def _cache_control_problem(body: Mapping[str, Any]) -> str | None:
    seen_short = False
    for where, marker in _marked(body):
        at = f"{where}.cache_control"
        if not isinstance(marker, dict) or marker.get("type") != "ephemeral":
            return f"{at}.type: Input should be 'ephemeral'"
        if set(marker) - {"type", "ttl"}:
            return f"{at}: Extra inputs are not permitted"
        ttl = marker.get("ttl", "5m")
        if ttl not in _TTLS:
            return f"{at}.ttl: Input should be '5m' or '1h'"
        if ttl == "1h" and seen_short:
            return "a ttl='1h' cache_control block must not come after a ttl='5m' one"
        seen_short = seen_short or ttl == "5m"
    return None
