"""Tool results as the model reads them, and the outcome of a call its tool never answered.

Pure. Called by `coordinator.calls` (collecting a turn's results, closing the calls of a
run that ends with calls open), by `outcomes` (a sequential turn's call answered
instead of sent) and by whoever answers a call for its tool: the watchdog, the liveness
probe, recovery, a parked call's expiry or cancel, a refused or invalid call.

`unanswered` is the one constructor of such an outcome. `unanswered_outcome` picks its
words by the situation, the same status word for the same situation wherever it is
written (the machine worker's words match):

    situation                                   never started     started
    a cancel to honour now (ui, or past the     cancelled         cancelled
      deadline)
    an operation cancel, a sequential turn's    cancelled         -
      call not yet sent
    the call's deadline passed                  timeout           lost (a machine call:
                                                                  its machine went
                                                                  quiet); timeout (a
                                                                  coordinator tool)
    its machine went away (liveness)            offline           lost
    a second copy finds it started, unanswered  -                 lost
    routed, or re-sent, to a machine offline    offline           -
    the dispatch that would have sent it died   lost              -
      (its refusal lost with it)
    no outcome at all when the turn closes      lost              lost

A tool's own words (`ok`, `error`, `timeout`, `cancelled`, `denied`, `invalid`) come from
the machine side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from cmdop_worker.core.fanout import copy_machine, is_copy, merged_outcome, parent_id
from cmdop_worker.models import Message, ToolOutcome, ToolStatus, Usage

Unanswered = Literal["cancel", "deadline", "machine_gone", "offline", "dispatch_lost", "no_result"]


class CallRef(Protocol):
    """What names a call: a pending call, a route, a machine's `ToolCall`."""

    @property
    def tool_use_id(self) -> str: ...

    @property
    def tool(self) -> str: ...

    @property
    def machine(self) -> str | None: ...


@dataclass(frozen=True)
class Call:
    """A call named by its tool_use block alone (no machine known)."""

    tool_use_id: str
    tool: str
    machine: str | None = None


def unanswered(call: CallRef, status: ToolStatus, why: str, *, duration_ms: int = 0) -> ToolOutcome:
    """The outcome of `call` written by someone other than its tool, in `why`'s words."""
    return ToolOutcome(
        tool_use_id=call.tool_use_id,
        tool=call.tool,
        machine=call.machine,
        status=status,
        output=why,
        duration_ms=duration_ms,
    )


def unanswered_outcome(
    call: CallRef, situation: Unanswered, *, started: bool = False, reason: str = ""
) -> ToolOutcome:
    """The outcome of a call answered for it, by the table in this module's docstring."""
    return unanswered(call, *_words(situation, call.machine, started=started, reason=reason))


def _words(
    situation: Unanswered, machine: str | None, *, started: bool, reason: str
) -> tuple[ToolStatus, str]:
    if situation == "cancel":
        return "cancelled", f"cancelled ({reason}) before it " + (
            "finished" if started else "started"
        )
    if situation == "offline":  # the words routing uses for a machine that is not there
        return "offline", f"machine {machine} is offline"
    if situation == "dispatch_lost":
        return "lost", "not run: the coordinator stopped while dispatching this call"
    if situation == "no_result":
        return "lost", "no result was recorded for this call"
    if started and (situation == "machine_gone" or machine is not None):
        return "lost", f"started on {machine}; outcome unknown; machine lost"
    if situation == "machine_gone":
        return "offline", f"machine {machine} went offline before running the call"
    if started:
        return "timeout", "no answer before the call's deadline"
    if machine is not None:
        return "timeout", f"machine {machine} did not run the call before its deadline"
    return "timeout", "not run before the call's deadline"


def result_block(outcome: ToolOutcome) -> dict[str, Any]:
    """The tool_result block the model reads for an outcome."""
    block: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": outcome.tool_use_id,
        "content": outcome.output or "(no output)",
    }
    if outcome.is_error:
        block["is_error"] = True
    return block


def collected(
    calls: Sequence[CallRef], stored: Mapping[str, ToolOutcome], usage: Usage
) -> tuple[Message, Usage]:
    """A finished turn's results as one user message, in the order of the calls (a call
    without an outcome: "no result was recorded"; a fan-out's copies: one result,
    `core.fanout.merged_outcome`), and `usage` with what they spent on the model (an
    ask's child runs: their spend is the run's)."""
    blocks = []
    for group in _by_call(calls):
        outcomes = [stored.get(c.tool_use_id) or unanswered_outcome(c, "no_result") for c in group]
        outcome = outcomes[0]
        if is_copy(group[0].tool_use_id):
            copies = [(_copy_machine(c), o) for c, o in zip(group, outcomes, strict=True)]
            outcome = merged_outcome(parent_id(group[0].tool_use_id), group[0].tool, copies)
        blocks.append(result_block(outcome))
        if outcome.usage is not None:
            usage = usage + outcome.usage
    return Message(role="user", content=blocks), usage


def _by_call(calls: Sequence[CallRef]) -> list[list[CallRef]]:
    """The calls, a fan-out's copies (next to each other) together under their call."""
    groups: list[list[CallRef]] = []
    for call in calls:
        if groups and is_copy(call.tool_use_id) and _same_call(groups[-1][0], call):
            groups[-1].append(call)
        else:
            groups.append([call])
    return groups


def _same_call(first: CallRef, call: CallRef) -> bool:
    return is_copy(first.tool_use_id) and parent_id(first.tool_use_id) == parent_id(
        call.tool_use_id
    )


def _copy_machine(call: CallRef) -> str:
    return call.machine or copy_machine(call.tool_use_id) or "?"


def open_calls(history: Sequence[Message]) -> list[Call]:
    """The tool calls of the last message, when it is the assistant's."""
    last = history[-1] if history else None
    if last is None or last.role != "assistant" or isinstance(last.content, str):
        return []
    return [Call(str(b["id"]), str(b["name"])) for b in last.content if b.get("type") == "tool_use"]


def closing_message(
    history: Sequence[Message], why: str, outcomes: Mapping[str, ToolOutcome]
) -> Message | None:
    """The results that answer every call of the last assistant message: its stored
    outcome for a call that has one, else cancelled with `why`; None: no call is open."""
    blocks = [
        result_block(outcomes.get(call.tool_use_id) or unanswered(call, "cancelled", why))
        for call in open_calls(history)
    ]
    return Message(role="user", content=blocks) if blocks else None
