"""Events with typed data: one envelope per event type, joined in a discriminated union.

`Event` (in `models`) keeps `data` as a plain object so that every reader tolerates
new event types; `typed_event(event)` gives the precise model for a known type, and
`event_json_schema()` is what `cmdop-worker schema event` prints. The data models
themselves live in `core.event_data`, where the writers take them from. Pure: no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter

from cmdop_worker.core.event_data import (
    ApprovalRequestData,
    ApprovalResolvedData,
    CancelledData,
    DoneData,
    ErrorData,
    RetryData,
    SteeredData,
    TextData,
    ToolEndData,
    ToolStartData,
)
from cmdop_worker.models import Event, Frozen


class _Envelope(Frozen):
    model_config = ConfigDict(frozen=True, extra="allow")

    run_id: str
    seq: int
    turn: int
    ts_ms: int


class TokenEvent(_Envelope):
    type: Literal["TOKEN"]
    data: TextData


class ThinkingEvent(_Envelope):
    type: Literal["THINKING"]
    data: TextData


class ToolStartEvent(_Envelope):
    type: Literal["TOOL_START"]
    data: ToolStartData


class ToolEndEvent(_Envelope):
    type: Literal["TOOL_END"]
    data: ToolEndData


class RetryEvent(_Envelope):
    type: Literal["RETRY"]
    data: RetryData


class ApprovalRequestEvent(_Envelope):
    type: Literal["APPROVAL_REQUEST"]
    data: ApprovalRequestData


class ApprovalResolvedEvent(_Envelope):
    type: Literal["APPROVAL_RESOLVED"]
    data: ApprovalResolvedData


class SteeredEvent(_Envelope):
    type: Literal["STEERED"]
    data: SteeredData


class ErrorEvent(_Envelope):
    type: Literal["ERROR"]
    data: ErrorData


class CancelledEvent(_Envelope):
    type: Literal["CANCELLED"]
    data: CancelledData


class DoneEvent(_Envelope):
    type: Literal["DONE"]
    data: DoneData


TypedEvent = Annotated[
    TokenEvent
    | ThinkingEvent
    | ToolStartEvent
    | ToolEndEvent
    | RetryEvent
    | ApprovalRequestEvent
    | ApprovalResolvedEvent
    | SteeredEvent
    | ErrorEvent
    | CancelledEvent
    | DoneEvent,
    Field(discriminator="type"),
]
TYPED_EVENT: TypeAdapter[TypedEvent] = TypeAdapter(TypedEvent)


def typed_event(event: Event | dict[str, Any] | str | bytes) -> TypedEvent:
    """The event with its data validated against its type's model."""
    if isinstance(event, str | bytes):
        return TYPED_EVENT.validate_json(event)
    raw = event.model_dump() if isinstance(event, Event) else event
    return TYPED_EVENT.validate_python(raw)


def event_json_schema() -> dict[str, Any]:
    schema = TYPED_EVENT.json_schema()
    schema["title"] = "Event"
    schema["description"] = (
        "One event of a cmdop-worker run, as stored in cmdop:run:<id>:events (field "
        "`event`) and published on cmdop:run:<id>:live. `seq` counts 1, 2, 3... per run; "
        "exactly one terminal event (ERROR, CANCELLED, DONE) ends a run. Readers should "
        "ignore unknown event types and unknown data fields."
    )
    return schema
