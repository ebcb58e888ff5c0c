"""What a line typed in `chat` means while calls wait for approval: `chat_answer`.

Only a command answers a call:

    /approve [CALL]          run it as the model asked
    /deny [CALL] [reason]    refuse it; the reason is told to the model
    /edit [CALL] {json}      run it with this input instead

CALL names the call (its id, or a prefix of it that names only one) and may be left
out while a single call waits. Every other line is a message to the run, whatever it
says: the model may have just asked a yes-or-no question, and "yes please keep a
copy" is its answer, never a person's approval of a command. Pure: the chat acts on
what this returns. Used by `chat`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

COMMANDS = ("/approve", "/deny", "/edit")
HINT = "/approve, /deny [reason] or /edit {json} answers it; any other line is a message"


@dataclass(frozen=True)
class Answer:
    """Answer `tool_call_id`: approve it (with `input` instead, when edited) or deny it."""

    tool_call_id: str
    approve: bool
    input: dict[str, Any] | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Refused:
    """A command that answers nothing, and why (shown; nothing is sent)."""

    message: str


def chat_answer(line: str, waiting: Sequence[str]) -> Answer | Refused | None:
    """The answer a typed line gives to one of the `waiting` calls (oldest first);
    None when the line is not a command, which makes it a message."""
    word, _, rest = line.strip().partition(" ")
    command = word.lower()
    if command not in COMMANDS:
        return None
    if not waiting:
        return Refused(f"{command}: no call waits for approval")
    call, rest = _named_call(rest.strip(), waiting)
    if isinstance(call, Refused):
        return call
    if command == "/approve":
        if rest:
            return Refused("/approve takes only a call id; /edit {json} changes the input")
        return Answer(call, approve=True)
    if command == "/deny":
        return Answer(call, approve=False, reason=rest or None)
    edited = _json_object(rest)
    if edited is None:
        return Refused("/edit needs the new input as a JSON object: /edit {...}")
    return Answer(call, approve=True, input=edited)


def _named_call(rest: str, waiting: Sequence[str]) -> tuple[str | Refused, str]:
    """The call a command names and the rest of its line. A first word that is a
    waiting call's id names it; while only one call waits, no id is needed (and a
    word that merely starts like its id is the reason, not the id)."""
    first, _, after = rest.partition(" ")
    if first in waiting:
        return first, after.strip()
    if len(waiting) == 1:
        return waiting[0], rest
    named = [call for call in waiting if first and call.startswith(first)]
    if len(named) == 1:
        return named[0], after.strip()
    ids = ", ".join(waiting)
    return Refused(f"{len(waiting)} calls wait for approval; name one by its id: {ids}"), rest


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
