"""A sequential turn's call as the coordinator stores it until its turn comes
(`barrier`): how it is to be sent, and its deadline once it is handed out.

Pure: a model and its one rule.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from cmdop_worker.models import ToolCall, ToolOutcome


class QueuedCall(BaseModel):
    """A call of a sequential turn, stored until its turn comes, and how to send it:
    to its machine's queue, to the coordinator, or answered at once (a refused call)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool_use_id: str
    tool: str
    send: Literal["machine", "coordinator", "answer"]
    input: Any = None  # as the call is shown in its TOOL_START
    call: ToolCall | None = None  # "machine": the message for its queue
    deadline_ms: int = 0  # the watchdog's deadline of the call (its own end plus grace)
    answer: ToolOutcome | None = None  # "answer": the refused call's outcome
    headers: dict[str, Any] = {}  # the trace context of the turn that made the call
    timeout_ms: int = 0  # its own time, from its hand-out (0: none, e.g. an answer)
    run_deadline_ms: int = 0  # which no deadline of the run's calls passes
    grace_ms: int = 0  # the watchdog's wait past the call's own end

    def handed_out(self, now_ms: int) -> QueuedCall:
        """The call as sent now its turn has come: its deadline counted from now (at
        most the run's), so no wait before it eats its own time. A call with no time of
        its own keeps what it was stored with."""
        if self.timeout_ms <= 0 or self.run_deadline_ms <= 0:
            return self
        ends_ms = min(now_ms + self.timeout_ms, self.run_deadline_ms)
        call = self.call
        if call is not None:
            call = call.model_copy(update={"deadline_ms": ends_ms})
        return self.model_copy(update={"deadline_ms": ends_ms + self.grace_ms, "call": call})
