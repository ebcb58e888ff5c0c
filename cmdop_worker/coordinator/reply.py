"""Taking the model's reply into the run, and the effects of what it asks for.

Called by `coordinator.turn.execute_turn` once a turn has its `Answer` (from the model
call, or stored by eager dispatch for a turn executed again). `take_reply` prices the
reply, repairs what the model sent malformed (`core.step.normalize_reply`), adds it to
the run's state, and says what comes next as a value: the core's `step_after_model`,
unless the run's cancel request or steering messages that came during the call say
otherwise (this is a loop boundary: after the model call, before its calls start). The turn
matches on that value and carries it out with the effects below (`coordinator.calls` for
the tool calls).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cmdop_worker.coordinator import calls, eager
from cmdop_worker.coordinator.finish import finish_cancelled
from cmdop_worker.coordinator.model_call import Answer
from cmdop_worker.coordinator.threads import steers_pending
from cmdop_worker.coordinator.turn_context import TurnContext
from cmdop_worker.core.step import (
    Fail,
    Finish,
    ModelReply,
    RetryOutput,
    RunTools,
    cancel_stop_reason,
    normalize_reply,
    step_after_model,
)
from cmdop_worker.messages import enqueue_turn
from cmdop_worker.models import CancelRequest, Message
from cmdop_worker.runtime import now_ms
from cmdop_worker.state.cancel import must_stop_now
from cmdop_worker.state.store import RunState


@dataclass(frozen=True)
class AnswerSteering:
    """The reply would finish the run, but a message steered it during the reply: the
    next turn answers it. (On the last turn a follow-up run does: `threads.hand_on`.)"""


@dataclass(frozen=True)
class CancelledAfterReply:
    """A cancel came during the model call: no call of the reply starts."""

    cancel: CancelRequest


@dataclass(frozen=True)
class SentRunOn:
    """An operation cancel came while calls sent early ran: they run on to their end,
    every other call is answered as cancelled before it started."""

    step: RunTools
    reason: str


AfterReply = (
    RunTools | Finish | RetryOutput | Fail | AnswerSteering | CancelledAfterReply | SentRunOn
)


@dataclass(frozen=True)
class ReplyTaken:
    """The run with the reply in its history, and what comes next."""

    state: RunState
    next: AfterReply


def take_reply(ctx: TurnContext, state: RunState, answer: Answer) -> ReplyTaken:
    """`state` with the reply stored in it, and what the reply asks for."""
    reply = _priced(answer.reply, state.model, at_ms=answer.called_ms)
    content, repairs = normalize_reply(reply.content, turn=ctx.turn, stop_reason=reply.stop_reason)
    state = state.model_copy(
        update={
            "turn": ctx.turn,
            "history": [*state.history, Message(role="assistant", content=content)],
            "usage": state.usage + reply.usage,
            "model_answered": reply.model,
            "text": state.text + reply.text,
        }
    )
    step = step_after_model(
        ModelReply(content, reply.stop_reason, reply.usage),
        output_schema=state.request.output_schema,
        output_retry_used=state.output_retry_used,
        repairs=repairs,
    )
    return ReplyTaken(state, _at_boundary(ctx, state, step, answer))


def _at_boundary(
    ctx: TurnContext,
    state: RunState,
    step: RunTools | Finish | RetryOutput | Fail,
    answer: Answer,
) -> AfterReply:
    """The step, unless a cancel or a steering message that came during the call
    changes it."""
    cancel = ctx.rt.store.cancel_request(ctx.run_id)
    if cancel is not None:
        stop_now = must_stop_now(cancel, now_ms=now_ms(), deadline_ms=state.deadline_ms)
        if answer.sent and isinstance(step, RunTools) and not stop_now:
            return SentRunOn(step, cancel.reason)
        return CancelledAfterReply(cancel)
    if isinstance(step, Finish) and ctx.turn < state.max_turns and steers_pending(ctx.rt, state):
        return AnswerSteering()
    return step


def start_calls(ctx: TurnContext, state: RunState, step: RunTools, answer: Answer) -> None:
    """Send the reply's calls on (those not sent early already)."""
    calls.start_calls(ctx.rt, state, ctx.turn, step, ctx.fleet, sent=answer.sent)


def let_sent_run_on(ctx: TurnContext, state: RunState, after: SentRunOn, answer: Answer) -> None:
    cancelled = after.reason
    calls.start_calls(
        ctx.rt, state, ctx.turn, after.step, ctx.fleet, sent=answer.sent, unsent_cancelled=cancelled
    )


def cancel_after_reply(
    ctx: TurnContext, state: RunState, cancel: CancelRequest, answer: Answer
) -> None:
    """End the run: each call of the reply answered, by its outcome if it went out."""
    why = f"cancelled ({cancel.reason})"
    outcomes = eager.answer_all(ctx.rt, state, ctx.turn, why) if answer.sent else None
    state = calls.close_open_calls(state, why, outcomes)
    finish_cancelled(
        ctx.rt, state, cancel.channel, cancel.reason, cancel_stop_reason(cancel.reason)
    )


def retry_output(ctx: TurnContext, state: RunState, step: RetryOutput) -> None:
    """Ask again for a final answer that failed the output schema, once."""
    retry = Message(role="user", content=step.message)
    update = {"history": [*state.history, retry], "output_retry_used": True}
    go_on(ctx, state.model_copy(update=update))


def go_on(ctx: TurnContext, state: RunState) -> None:
    """Save the run and enqueue its next turn."""
    ctx.rt.store.save(state)
    enqueue_turn(ctx.run_id, ctx.turn + 1)


def _priced(reply: ModelReply, requested: str, *, at_ms: int) -> ModelReply:
    """The reply with its cost: at the price of the model that answered (as the
    response names it), else of the one asked for."""
    from cmdop_worker.llm.pricing import has_price, priced

    model = reply.model if reply.model and has_price(reply.model) else requested
    return dataclasses.replace(reply, usage=priced(reply.usage, model, at_ms=at_ms))
