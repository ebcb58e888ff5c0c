"""The next step of a run, as a value.

The coordinator's turn task asks two questions and carries out the answer:

- `step_before_model`: may this turn call the model? (`CallModel`, or the run ends:
  `Finish` on the turn limit, the token budget or the dollar budget, `Cancelled` on a
  cancel or the deadline)
- `step_after_model`: what does the reply mean? (`RunTools`, `Finish`,
  `RetryOutput` when the final answer failed the output schema the first time, `Fail`)

`normalize_reply` repairs what a model may send malformed (a tool_use with no id, or
arguments that are not an object, or a call cut off by `max_tokens`) so the stored
history always stays valid for the API, and reports each repair so the call can be
answered with an error result instead of being run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cmdop_worker.core.output import output_retry_message, parse_final_output
from cmdop_worker.models import CancelChannel, CancelRequest, StopReason, Usage


@dataclass(frozen=True)
class ModelReply:
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: Usage
    model: str | None = None  # as the response names it, for traces
    response_id: str | None = None

    @property
    def text(self) -> str:
        return "".join(b.get("text", "") for b in self.content if b.get("type") == "text")

    @property
    def tool_uses(self) -> list[dict[str, Any]]:
        return [b for b in self.content if b.get("type") == "tool_use"]


@dataclass(frozen=True)
class CallModel:
    pass


@dataclass(frozen=True)
class RunTools:
    """The reply asks for tools: route and send its calls (`coordinator.calls`); a
    repaired call (`normalize_reply`) is answered with its repair instead."""

    tool_uses: tuple[dict[str, Any], ...]
    repairs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Finish:
    text: str
    stop_reason: StopReason
    output: Any = None


@dataclass(frozen=True)
class RetryOutput:
    message: str


@dataclass(frozen=True)
class Fail:
    kind: str
    message: str


@dataclass(frozen=True)
class Cancelled:
    channel: CancelChannel
    reason: str
    stop_reason: StopReason


Step = CallModel | RunTools | Finish | RetryOutput | Fail | Cancelled


@dataclass(frozen=True)
class TurnFacts:
    """What the decision before a model call needs to know about the run."""

    turn: int
    max_turns: int
    usage: Usage
    token_budget: int
    last_text: str
    cancel: CancelRequest | None
    now_ms: int
    deadline_ms: int
    budget_usd: float | None = None


def cancel_stop_reason(reason: str) -> StopReason:
    """The stop reason of a run ended by a cancel: the deadline's says `timeout`."""
    return "timeout" if reason == "timeout" else "cancelled"


def step_before_model(facts: TurnFacts) -> CallModel | Finish | Cancelled:
    if facts.cancel is not None:
        stop = cancel_stop_reason(facts.cancel.reason)
        return Cancelled(facts.cancel.channel, facts.cancel.reason, stop)
    if facts.now_ms >= facts.deadline_ms:
        return Cancelled("operation", "timeout", "timeout")
    if facts.turn > facts.max_turns:
        return Finish(facts.last_text, "max_turns")
    if facts.usage.total_tokens >= facts.token_budget or budget_spent(
        facts.usage, facts.budget_usd
    ):
        return Finish(facts.last_text, "budget")
    return CallModel()


def budget_spent(usage: Usage, budget_usd: float | None) -> bool:
    """Whether a dollar budget is used up. A cost that became unknown (a model the
    price table does not know answered) counts as spent: the cap cannot be kept."""
    if budget_usd is None:
        return False
    return usage.cost_usd is None or usage.cost_usd >= budget_usd


def step_after_model(
    reply: ModelReply,
    *,
    output_schema: Mapping[str, Any] | None,
    output_retry_used: bool,
    repairs: Mapping[str, str],
) -> RunTools | Finish | RetryOutput | Fail:
    if reply.tool_uses:
        return RunTools(tuple(reply.tool_uses), repairs)
    if output_schema is None:
        # The model's own stop reason says whether the answer was cut off.
        return Finish(reply.text, "max_tokens" if reply.stop_reason == "max_tokens" else "end_turn")
    value, error = parse_final_output(reply.text, output_schema)
    if error is None:
        return Finish(reply.text, "end_turn", value)
    if not output_retry_used:
        return RetryOutput(output_retry_message(error, output_schema))
    return Fail("output_invalid", f"the final answer does not match output_schema: {error}")


CUT_OFF = (
    "the call was cut off by the output token limit (max_tokens) before its input was "
    "complete; it was not run. Send it again, with a shorter input if it was long."
)


def normalize_reply(
    content: Sequence[Mapping[str, Any]], *, turn: int, stop_reason: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Content safe to store, and the repairs made, keyed by tool_use id.

    A reply stopped by `max_tokens` whose last block is a tool_use was cut off while
    writing that call: its input (read as far as it went) is never run; the call is
    answered with `CUT_OFF` instead. Calls before it were complete."""
    fixed: list[dict[str, Any]] = []
    repairs: dict[str, str] = {}
    seen: set[str] = set()
    for index, block in enumerate(content):
        item = dict(block)
        if item.get("type") == "tool_use":
            item, problem = _normalize_tool_use(item, turn, index, seen)
            if stop_reason == "max_tokens" and index == len(content) - 1:
                problem = CUT_OFF
            if problem:
                repairs[item["id"]] = problem
            seen.add(item["id"])
        fixed.append(item)
    return fixed, repairs


def _normalize_tool_use(
    item: dict[str, Any], turn: int, index: int, seen: set[str]
) -> tuple[dict[str, Any], str | None]:
    problem = None
    tool_use_id = item.get("id")
    if not isinstance(tool_use_id, str) or not tool_use_id or tool_use_id in seen:
        item["id"] = f"toolu_cmdop_t{turn}_{index}"
        problem = "the call had no usable id; it was not run"
    if not isinstance(item.get("input"), dict):
        item["input"] = {}
        problem = problem or "the arguments were not a JSON object; the call was not run"
    if not isinstance(item.get("name"), str):
        item["name"] = "unknown"
        problem = problem or "the call named no tool"
    return item, problem
