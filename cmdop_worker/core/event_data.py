"""What each event says: its data, one model per event type, and the pure builders of it.

`state.events.EventSink` writes these (`EventPayload`: each model carries its event
type, so an event's type and its data cannot disagree; `EventData.wire` gives the JSON
the contract describes) and readers parse them (`surfaces.typed_events`, which wraps
them in the envelopes). The envelope itself, `models.Event`, keeps `data` a plain
object so that every reader tolerates new event types. Writers: the coordinator
(`finish`, `threads`, `model_call`, `local_tools`), the machine side (`worker`,
`parked`), `outcomes` and `state.approvals`. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, get_args

from pydantic import BaseModel, ConfigDict

from cmdop_worker.models import (
    ApprovalAnswer,
    ApprovalVerdict,
    CancelChannel,
    EventType,
    StopReason,
    ToolOutcome,
    ToolStatus,
    Usage,
)


class NamedCall(Protocol):
    """What a TOOL_START names of its call: a `ToolCall`, a coordinator tool's route,
    a `ToolOutcome`."""

    @property
    def tool_use_id(self) -> str: ...
    @property
    def tool(self) -> str: ...


# `extra="allow"`: fields may be added to an event's data over time.
class EventData(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")

    # The contract leaves these fields out of the event's JSON when they are None.
    omitted_when_none: ClassVar[frozenset[str]] = frozenset()

    def wire(self) -> dict[str, Any]:
        """The data as the event's JSON carries it: the fields in declaration order,
        any the contract omits without a value left out."""
        absent = {name for name in self.omitted_when_none if getattr(self, name) is None}
        return self.model_dump(exclude=absent)


class TextData(EventData):  # a TOKEN's or THINKING's data, as readers parse both
    text: str


class TokenData(TextData):
    event_type: ClassVar[EventType] = "TOKEN"  # the next fragment of the answer


class ThinkingData(TextData):
    event_type: ClassVar[EventType] = "THINKING"  # the next fragment of the thinking


class ToolStartData(EventData):
    event_type: ClassVar[EventType] = "TOOL_START"

    tool_call_id: str
    tool: str
    machine: str | None  # written as null for a coordinator tool
    input: Any

    @classmethod
    def of(cls, call: NamedCall, *, machine: str | None, input: Any) -> ToolStartData:
        """The TOOL_START of a call (a machine's or a coordinator tool's, or the one an
        outcome answers), run on `machine` (None: the coordinator) with `input`."""
        return cls(tool_call_id=call.tool_use_id, tool=call.tool, machine=machine, input=input)


class ToolEndData(EventData):
    event_type: ClassVar[EventType] = "TOOL_END"

    tool_call_id: str
    tool: str
    machine: str | None
    is_error: bool
    status: ToolStatus = "ok"
    output: str
    duration_ms: int
    waited_ms: int = 0

    @classmethod
    def of(cls, outcome: ToolOutcome, *, max_output_chars: int) -> ToolEndData:
        """The TOOL_END of an outcome, its output shortened to `max_output_chars`."""
        output = outcome.output
        if len(output) > max_output_chars:
            more = len(outcome.output) - max_output_chars
            output = output[:max_output_chars] + f"… [{more} more characters]"
        return cls(
            tool_call_id=outcome.tool_use_id,
            tool=outcome.tool,
            machine=outcome.machine,
            is_error=outcome.is_error,
            status=outcome.status,
            output=output,
            duration_ms=outcome.duration_ms,
            waited_ms=outcome.waited_ms,
        )


class RetryData(EventData):
    event_type: ClassVar[EventType] = "RETRY"

    attempt: int
    delay_ms: int
    cause: str


class ApprovalRequestData(EventData):
    event_type: ClassVar[EventType] = "APPROVAL_REQUEST"
    omitted_when_none = frozenset({"resolved_input"})

    tool_call_id: str
    tool: str
    machine: str | None
    input: Any
    reason: str
    timeout_s: float
    resolved_input: dict[str, Any] | None = None  # the input as the gate resolved it (paths)


class ApprovalResolvedData(EventData):
    event_type: ClassVar[EventType] = "APPROVAL_RESOLVED"
    omitted_when_none = frozenset({"reason", "input"})

    tool_call_id: str
    verdict: ApprovalVerdict
    by: str
    reason: str | None = None  # a denial's reason, as the model is told it
    input: dict[str, Any] | None = None  # the edited input, when the person changed it

    @classmethod
    def of(cls, tool_use_id: str, answer: ApprovalAnswer) -> ApprovalResolvedData:
        """How the answer to a parked call is announced."""
        return cls(
            tool_call_id=tool_use_id,
            verdict=answer.verdict,
            by=answer.by,
            reason=answer.reason,
            input=answer.input,
        )


class SteeredData(EventData):
    event_type: ClassVar[EventType] = "STEERED"

    text: str  # the message added to the run's history at this boundary


class ErrorData(EventData):
    event_type: ClassVar[EventType] = "ERROR"

    kind: str
    message: str


class CancelledData(EventData):
    event_type: ClassVar[EventType] = "CANCELLED"

    channel: CancelChannel
    reason: str
    partial_text: str
    usage: Usage


class DoneData(EventData):
    event_type: ClassVar[EventType] = "DONE"

    text: str
    usage: Usage
    turns: int
    stop_reason: StopReason
    model: str | None = None  # which model answered the last turn (null: none did)
    output: Any = None  # present when the request had an output_schema, even if null

    def wire(self) -> dict[str, Any]:
        data = super().wire()
        if "output" not in self.model_fields_set:
            del data["output"]
        return data


# The data of an event the sink writes: exactly one model per event type.
EventPayload = (
    TokenData
    | ThinkingData
    | ToolStartData
    | ToolEndData
    | RetryData
    | ApprovalRequestData
    | ApprovalResolvedData
    | SteeredData
    | ErrorData
    | CancelledData
    | DoneData
)
EVENT_PAYLOADS: tuple[type[EventData], ...] = get_args(EventPayload)
