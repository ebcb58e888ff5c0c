"""Converting the anthropic SDK's message objects into the loop's plain values.

Called by `llm` once a call returns. Only the block types the Messages API accepts
back in history are kept, with only the fields it accepts, so a stored reply can be
sent again verbatim on the next turn (and stays byte-identical for prompt caching).
"""

from __future__ import annotations

from typing import Any

from cmdop_worker.core.step import ModelReply
from cmdop_worker.models import Usage

_BLOCK_KEYS = {
    "text": ("type", "text"),
    "thinking": ("type", "thinking", "signature"),
    "redacted_thinking": ("type", "data"),
    "tool_use": ("type", "id", "name", "input"),
}


def reply_of(message: Any) -> ModelReply:
    content = [_block_dict(block) for block in message.content]
    usage = message.usage
    return ModelReply(
        content=[b for b in content if b is not None],
        stop_reason=message.stop_reason,
        usage=Usage(
            input_tokens=usage.input_tokens or 0,
            output_tokens=usage.output_tokens or 0,
            cache_read_input_tokens=getattr(usage, "cache_read_input_tokens", None) or 0,
            cache_creation_input_tokens=getattr(usage, "cache_creation_input_tokens", None) or 0,
        ),
    )


def _block_dict(block: Any) -> dict[str, Any] | None:
    data = block.model_dump(mode="json")
    keys = _BLOCK_KEYS.get(data.get("type", ""))
    if keys is None:
        return None
    return {k: data[k] for k in keys if k in data and data[k] is not None}
