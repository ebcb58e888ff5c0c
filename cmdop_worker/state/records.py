"""A run's record as the store keeps it: `RunState`, its pending calls, its parent link.

Frozen pydantic models, written and read by `store.RunStore` (which re-exports them,
so callers import them from there), built by the coordinator. Pure: no Redis here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from cmdop_worker.core.fanout import copy_inputs
from cmdop_worker.models import Message, RunRequest, RunStatus, Usage


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PendingCall(Frozen):
    """A tool call of the turn in flight, awaiting its outcome."""

    tool_use_id: str
    tool: str
    machine: str | None = None
    deadline_ms: int


class ParentLink(Frozen):
    """Set on a child run started by `ask_machine`: where its answer goes."""

    run_id: str
    turn: int
    tool_use_id: str
    tool: str
    host: str
    depth: int  # the child's: a top-level run is 0


class RunState(Frozen):
    run_id: str
    request: RunRequest
    model: str
    system_prompt: str
    max_turns: int
    parallel_tools: bool  # the agent's and the request's, resolved when the run starts
    tool_tags: list[str] | None = None
    token_budget: int
    status: RunStatus = "running"
    turn: int = 0
    history: list[Message]
    usage: Usage = Usage()
    awaiting: list[PendingCall] = []
    started_ms: int
    deadline_ms: int
    text: str = ""
    output_retry_used: bool = False
    parent: ParentLink | None = None
    origin: str = ""  # the task that started the run: its redelivery is not a duplicate
    steers_applied: int = 0  # how many messages of the run's steer list are in history
    # The API's `thinking` object for every turn, resolved once when the run starts:
    # a run may not switch thinking on or off between the turns of a tool loop.
    thinking: dict[str, Any] | None = None
    fallback_models: list[str] = []  # the agent's, resolved when the run starts
    model_answered: str | None = None  # the model of the last reply (DONE's `model`)
    copy_key: str = ""  # keys its fan-out copies' ids (`core.fanout.copy_id`); never shown

    @property
    def depth(self) -> int:
        """How deep in `ask_machine` runs this one is: 0 top-level, 1 its child, ..."""
        return self.parent.depth if self.parent is not None else 0


def parse_state(raw: str | bytes | None) -> RunState | None:
    """A run record as stored (`RunStore.load_raw`), parsed; None for no record."""
    return None if raw is None else RunState.model_validate_json(raw)


def tool_inputs(state: RunState) -> dict[str, object]:
    """Each tool call's input as the model wrote it, from the run's last assistant
    message with tool calls (the turn in flight): what a TOOL_START shows. A fan-out's
    copies (`core.fanout`) among the calls awaited: the call's input, addressed to the
    copy's machine."""
    for message in reversed(state.history):
        if message.role == "assistant" and not isinstance(message.content, str):
            uses = [b for b in message.content if b.get("type") == "tool_use"]
            if uses:
                inputs = {str(b.get("id")): b.get("input") for b in uses}
                return {**inputs, **copy_inputs(inputs, [c.tool_use_id for c in state.awaiting])}
    return {}
