"""A turn's call to the model: the prepared call, and what came of it, as values.

`coordinator.prepare` builds the `ModelCall`; `coordinator.turn` hands it to
`call_model`, which makes the call through the model seam (`llm.client`), writes
its fragments and retries as the turn's events, and returns either the `Answer`
(the reply, with the calls eager dispatch already sent) or `Ended`: the run ended
during the call (a cancel, the deadline, a model error), with the state to finish
it with. This module finishes nothing itself; the turn does, by matching on the value.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cmdop_worker import metrics
from cmdop_worker.coordinator.eager import EarlySender
from cmdop_worker.coordinator.turn_context import TurnContext
from cmdop_worker.core.event_data import RetryData, ThinkingData, TokenData
from cmdop_worker.core.routing import ToMachine
from cmdop_worker.core.step import Cancelled, Fail, ModelReply, cancel_stop_reason
from cmdop_worker.errors import ModelError, StopNow
from cmdop_worker.models import CancelRequest
from cmdop_worker.runtime import now_ms
from cmdop_worker.state.store import RunState

if TYPE_CHECKING:  # the model client (and its SDK) is loaded only where it is used
    from cmdop_worker.llm.client import RetryNotice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelCall:
    """A turn's model call, ready to make. `state`: the run as the request was built
    from it (old tool results cleared); `early`: eager dispatch, when the reply's
    calls go out while it streams; `already_emitted`: this turn's text that clients
    saw in an earlier attempt, not sent again."""

    state: RunState
    request: dict[str, Any]
    stream: bool
    already_emitted: str
    early: EarlySender | None
    called_ms: int


@dataclass(frozen=True)
class Answer:
    """The model's reply to a turn. `sent`: its calls already out (eager dispatch, or a
    resumed turn's); `called_ms`: when it was asked (for its price)."""

    reply: ModelReply
    called_ms: int
    sent: Mapping[str, ToMachine] = field(default_factory=dict)


@dataclass(frozen=True)
class Ended:
    """The run ended during the model call: finish `state` as `step` says."""

    state: RunState
    step: Cancelled | Fail


def call_model(ctx: TurnContext, call: ModelCall) -> Answer | Ended:
    """Ask the model for the turn's reply, streaming its fragments as events."""
    from cmdop_worker.llm.client import model_client

    sink = _TurnSink(ctx)
    deadline_s = time.monotonic() + (call.state.deadline_ms - now_ms()) / 1000
    started, outcome = time.monotonic(), "ok"
    with ctx.rt.hub.watch(ctx.run_id, call.state.deadline_ms) as watch:
        try:
            reply = model_client(ctx.rt).complete(
                call.request,
                stream=call.stream,
                emit=sink.emit,
                watch=watch,
                deadline_s=deadline_s,
                on_retry=sink.on_retry,
                already_emitted=call.already_emitted,
                fallbacks=call.state.fallback_models,
                on_block=call.early,
            )
        except StopNow as stop:
            outcome = "cancelled"
            cancel = watch.request or ctx.rt.store.cancel_request(ctx.run_id)
            return _stopped(ctx, call, cancel, stop.partial_text)
        except ModelError as exc:
            outcome = "error"
            return _failed(ctx, call, exc)
        finally:
            metrics.MODEL_CALL_SECONDS.labels(outcome=outcome).observe(time.monotonic() - started)
    return Answer(reply, call.called_ms, call.early.sent if call.early is not None else {})


def _ending(ctx: TurnContext, call: ModelCall) -> RunState:
    # If the run ends during the call, it ends in this turn.
    return call.state.model_copy(update={"turn": ctx.turn})


def _stopped(
    ctx: TurnContext, call: ModelCall, cancel: CancelRequest | None, partial_text: str
) -> Ended:
    """A cancel (or the deadline) stopped the call: the text streamed so far is kept."""
    channel = cancel.channel if cancel else "operation"
    reason = cancel.reason if cancel else "timeout"
    state = _ending(ctx, call)
    state = state.model_copy(update={"text": state.text + partial_text})
    if call.early is not None:  # calls sent early: in history, answered
        state = call.early.closed_out(state, f"cancelled ({reason})")
    return Ended(state, Cancelled(channel, reason, cancel_stop_reason(reason)))


def _failed(ctx: TurnContext, call: ModelCall, exc: ModelError) -> Ended:
    state = _ending(ctx, call)
    if call.early is not None:
        state = call.early.closed_out(state, f"not finished ({exc.kind})")
    if exc.kind == "deadline":
        return Ended(state, Cancelled("operation", "timeout", "timeout"))
    tried = f" (after {exc.attempts} attempts)" if exc.attempts else ""
    return Ended(state, Fail(f"model_{exc.kind}", exc.message + tried))


class _TurnSink:
    """Where a turn's model call reports: fragments and retries become events."""

    def __init__(self, ctx: TurnContext) -> None:
        self.rt, self.run_id, self.turn = ctx.rt, ctx.run_id, ctx.turn

    def emit(self, kind: Literal["TOKEN", "THINKING"], text: str) -> None:
        data = TokenData(text=text) if kind == "TOKEN" else ThinkingData(text=text)
        self.rt.events.emit(self.run_id, self.turn, data)

    def on_retry(self, notice: RetryNotice) -> None:
        waits = notice.cause.startswith("rate_limit_wait")  # for the fleet's limiter: no failure
        log.log(
            logging.INFO if waits else logging.WARNING,
            "run %s turn %s: model attempt %s %s (%s); going on in %.2fs",
            self.run_id,
            self.turn,
            notice.attempt,
            "waits" if waits else "failed",
            notice.cause,
            notice.delay_s,
        )
        metrics.MODEL_RETRIES.labels(cause=notice.cause.split(":", 1)[0]).inc()
        delay_ms = int(notice.delay_s * 1000)
        data = RetryData(attempt=notice.attempt, delay_ms=delay_ms, cause=notice.cause)
        self.rt.events.emit(self.run_id, self.turn, data)
