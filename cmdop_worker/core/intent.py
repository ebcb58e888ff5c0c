"""The intent router: does this turn need tools at all?

Off by default (`CMDOP_INTENT_ROUTER=on` turns it on). When on, the coordinator's turn
task asks a small model to classify the conversation's latest user message as DIRECT
(answer from knowledge, no tools) or AGENT (needs tools), and a DIRECT turn is sent
without tool definitions. Anything but a clear DIRECT — a failed call, an unclear
answer — means AGENT: mis-routing a tool-needing turn costs more than the tokens saved.

Pure: builds the classifier's request and reads its answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from cmdop_worker.models import Message

Intent = Literal["DIRECT", "AGENT"]

CLASSIFIER_SYSTEM = (
    "You route requests for an operator that can run commands and read files on a fleet "
    "of machines. Reply with exactly one word: DIRECT if the latest user message can be "
    "answered fully without looking at or acting on any machine, AGENT otherwise."
)


def latest_user_text(history: Sequence[Message]) -> str:
    for message in reversed(history):
        if message.role != "user":
            continue
        if isinstance(message.content, str):
            return message.content
        texts = [b.get("text", "") for b in message.content if b.get("type") == "text"]
        if texts:
            return "\n".join(texts)
    return ""


def classifier_request(model: str, history: Sequence[Message]) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 5,
        "system": CLASSIFIER_SYSTEM,
        "messages": [{"role": "user", "content": latest_user_text(history)[:4000] or "(empty)"}],
    }


def parse_intent(answer: str | None) -> Intent:
    word = (answer or "").strip().upper()
    return "DIRECT" if word.startswith("DIRECT") else "AGENT"


def has_tool_blocks(history: Sequence[Message]) -> bool:
    """Whether any message holds a tool_use or tool_result: such a history cannot be
    sent without tool definitions, so the router must answer AGENT."""
    return any(
        not isinstance(m.content, str)
        and any(b.get("type") in ("tool_use", "tool_result") for b in m.content)
        for m in history
    )
