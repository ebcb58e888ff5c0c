"""The coordinator's turn: load the run, ask the core what to do, do it, save, go on.

Called by the `cmdop.turn` task with (run_id, turn). A turn may run only when the run
is still running, the previous turn's tool results are all in (they are collected into
history first), and nobody else holds the turn's lock; anything else is a duplicate
delivery and does nothing.

Each step of a turn is a value this module matches on: the decision before the model
call (`prepare.decide_before_model`), the call's outcome (`model_call.call_model`: an
`Answer`, or `Ended`), and what the reply asks for (`reply.take_reply`). The decisions
are the pure core's (`core.step`, `core.catalog`, `core.request`, `core.routing`); the
steps load, call and emit; this module carries out what they return.
"""

from __future__ import annotations

import logging
from typing import assert_never

from cmdop_worker import metrics
from cmdop_worker.coordinator import calls, eager, reply
from cmdop_worker.coordinator.eager import Resumed
from cmdop_worker.coordinator.finish import finish_cancelled, finish_done, finish_error
from cmdop_worker.coordinator.lease import TurnLease
from cmdop_worker.coordinator.model_call import Answer, Ended, call_model
from cmdop_worker.coordinator.prepare import decide_before_model, prepare_call
from cmdop_worker.coordinator.threads import apply_steers
from cmdop_worker.coordinator.turn_context import TurnContext
from cmdop_worker.core.step import (
    CallModel,
    Cancelled,
    Fail,
    Finish,
    RetryOutput,
    RunTools,
)
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.store import RunState, parse_state

log = logging.getLogger(__name__)


def execute_turn(rt: Runtime, run_id: str, turn: int) -> None:
    raw = rt.store.load_raw(run_id)
    seen = parse_state(raw)
    if _next_turn(seen, turn) is None:
        log.info("run %s: turn %s already handled; skipping duplicate", run_id, turn)
        return
    # A short lease renewed while we work, not a long lock: if this process dies, the
    # turn is free again (and re-enqueued by the watchdog) within one lease.
    lease = TurnLease(rt, run_id, turn)
    if not lease.acquire():
        log.info("run %s: turn %s is being executed elsewhere", run_id, turn)
        return
    with lease:
        # Again as of taking the lease (read in the same step): the previous holder
        # may have finished the turn meanwhile. Unchanged, it is not parsed twice.
        current = seen if lease.state == raw else parse_state(lease.state)
        state = _next_turn(current, turn)
        if state is None:
            lease.keep_entry()
            return
        _begin(rt, state, turn, lease)


def _next_turn(state: RunState | None, turn: int) -> RunState | None:
    """The run's state when `turn` is the one to execute next."""
    if state is None or state.status != "running" or state.turn != turn - 1:
        return None
    return state


def _begin(rt: Runtime, state: RunState, turn: int, lease: TurnLease) -> None:
    """A loop boundary: the previous turn's results and the steering messages join the
    history, then the turn runs unless its attempts are spent."""
    if state.awaiting:  # the previous turn's results, into history
        state = calls.collect_results(rt, state)
    # An attempt before sent calls early: the turn goes on with their reply, whatever
    # else holds, and takes only the steering messages that reply was written after.
    resumed = None if lease.attempt == 1 else eager.resume(rt, state.run_id, turn)
    upto = resumed.steers_applied if resumed is not None else None
    state = apply_steers(rt, state, turn, upto=upto)  # a boundary: the next request sees them
    if lease.exhausted:
        why = f"turn {turn} failed {lease.attempt - 1} times: {lease.last_error()}"
        state = state.model_copy(update={"turn": turn})
        if resumed is not None:
            state = eager.closed(rt, state, turn, resumed.reply.content, f"not run: {why}")
        finish_error(rt, state, "turn_failed", why)
        return
    ctx = TurnContext(rt, state, turn, lease.attempt)
    with metrics.TURN_SECONDS.time():
        _take_turn(ctx, resumed)


def _take_turn(ctx: TurnContext, resumed: Resumed | None) -> None:
    if resumed is not None:  # the stored reply: the model is not asked again
        _carry_out(ctx, ctx.state, Answer(resumed.reply, now_ms(), resumed.kept))
        return
    step = decide_before_model(ctx)
    match step:
        case Finish() | Cancelled():
            _end(ctx, ctx.state, step)
        case CallModel():
            _ask_model(ctx)
        case _:
            assert_never(step)


def _ask_model(ctx: TurnContext) -> None:
    call = prepare_call(ctx)
    outcome = call_model(ctx, call)
    match outcome:
        case Answer():
            _carry_out(ctx, call.state, outcome)
        case Ended():
            _end(ctx, outcome.state, outcome.step)
        case _:
            assert_never(outcome)


def _carry_out(ctx: TurnContext, state: RunState, answer: Answer) -> None:
    """Store the reply in the run and carry out what it asks for."""
    taken = reply.take_reply(ctx, state, answer)
    state, step = taken.state, taken.next
    match step:
        case RunTools():
            reply.start_calls(ctx, state, step, answer)
        case Finish() | Fail():
            _end(ctx, state, step)
        case RetryOutput():
            reply.retry_output(ctx, state, step)
        case reply.AnswerSteering():
            reply.go_on(ctx, state)
        case reply.CancelledAfterReply():
            reply.cancel_after_reply(ctx, state, step.cancel, answer)
        case reply.SentRunOn():
            reply.let_sent_run_on(ctx, state, step, answer)
        case _:
            assert_never(step)


def _end(ctx: TurnContext, state: RunState, step: Finish | Cancelled | Fail) -> None:
    """Finish the run as `step` says."""
    match step:
        case Finish():
            finish_done(ctx.rt, state, step)
        case Cancelled():
            finish_cancelled(ctx.rt, state, step.channel, step.reason, step.stop_reason)
        case Fail():
            finish_error(ctx.rt, state, step.kind, step.message)
        case _:
            assert_never(step)
