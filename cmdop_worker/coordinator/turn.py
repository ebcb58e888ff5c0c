"""The coordinator's turn: load the run, ask the core what to do, do it, save, go on.

Called by the `cmdop.turn` task with (run_id, turn). A turn may run only when the run
is still running, the previous turn's tool results are all in (they are collected into
history first), and nobody else holds the turn's lock; anything else is a duplicate
delivery and does nothing. The decisions are the pure core's (`core.step`,
`core.catalog`, `core.request`, `core.routing`); this module only loads, calls, emits,
saves and enqueues.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, assert_never

from cmdop_worker import metrics
from cmdop_worker.coordinator import dispatch, eager
from cmdop_worker.coordinator.eager import EagerDispatch
from cmdop_worker.coordinator.finish import finish_cancelled, finish_done, finish_error
from cmdop_worker.coordinator.lease import TurnLease
from cmdop_worker.coordinator.threads import apply_steers, steers_pending
from cmdop_worker.core import tools
from cmdop_worker.core.catalog import fleet_catalog, hidden_tools, resolve_tools
from cmdop_worker.core.clearing import clear_old_results
from cmdop_worker.core.context import system_prompt, turn_reminder
from cmdop_worker.core.history import sanitize_history
from cmdop_worker.core.intent import classifier_request, has_tool_blocks, parse_intent
from cmdop_worker.core.request import build_request
from cmdop_worker.core.routing import Dispatch, Fleet
from cmdop_worker.core.step import (
    CallModel,
    Cancelled,
    DispatchTools,
    Fail,
    Finish,
    ModelReply,
    RetryOutput,
    TurnFacts,
    cancel_stop_reason,
    normalize_reply,
    step_after_model,
    step_before_model,
)
from cmdop_worker.errors import ModelError, StopNow
from cmdop_worker.models import Message, ToolSpec
from cmdop_worker.messages import enqueue_turn
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.cancel import must_stop_now
from cmdop_worker.state.events import turn_text
from cmdop_worker.state.presence import online_machines
from cmdop_worker.state.store import RunState, parse_state

if TYPE_CHECKING:  # the model client (and its SDK) is loaded only where it is used
    from cmdop_worker.llm.client import RetryNotice

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
        if state.awaiting:  # the previous turn's results, into history
            state = dispatch.collect_outcomes(rt, state)
        # An attempt before sent calls early: the turn goes on with their reply, whatever
        # else holds, and takes only the steering messages that reply was written after.
        resumed = None if lease.attempt == 1 else eager.resume(rt, run_id, turn)
        upto = resumed.steers_applied if resumed is not None else None
        state = apply_steers(rt, state, turn, upto=upto)  # a boundary: the next request sees them
        if lease.exhausted:
            why = f"turn {turn} failed {lease.attempt - 1} times: {lease.last_error()}"
            state = state.model_copy(update={"turn": turn})
            if resumed is not None:
                state = eager.closed(rt, state, turn, resumed.reply.content, f"not run: {why}")
            finish_error(rt, state, "turn_failed", why)
            return
        with metrics.TURN_SECONDS.time():
            if resumed is not None:
                catalog, at_ms = _catalog(rt, state), now_ms()
                _take_reply(rt, state, turn, resumed.reply, catalog, resumed.kept, None, at_ms)
            else:
                _advance(rt, state, turn, first_attempt=lease.attempt == 1)


def _next_turn(state: RunState | None, turn: int) -> RunState | None:
    """The run's state when `turn` is the one to execute next."""
    if state is None or state.status != "running" or state.turn != turn - 1:
        return None
    return state


def _advance(rt: Runtime, state: RunState, turn: int, *, first_attempt: bool) -> None:
    facts = TurnFacts(
        turn=turn,
        max_turns=state.max_turns,
        usage=state.usage,
        token_budget=state.token_budget,
        last_text=_last_text(state),
        cancel=rt.store.cancel_request(state.run_id),
        now_ms=now_ms(),
        deadline_ms=state.deadline_ms,
        budget_usd=state.request.budget_usd,
    )
    step = step_before_model(facts)
    match step:
        case Finish():
            finish_done(rt, state, step)
        case Cancelled():
            finish_cancelled(rt, state, step.channel, step.reason, step.stop_reason)
        case CallModel():
            _call_model(rt, state, turn, first_attempt=first_attempt)
        case _:
            assert_never(step)


def _call_model(rt: Runtime, state: RunState, turn: int, *, first_attempt: bool) -> None:
    catalog = _catalog(rt, state)
    tools = resolve_tools(
        catalog,
        turn=turn,
        tool_tags=state.tool_tags,
        hidden=hidden_tools(rt.hide_map, state.request.platform, state.request.mode),
        direct=_is_direct(rt, state),
    )
    state = _within_context(rt, state, turn)  # stored with this turn's reply
    request = _build_request(rt, state, tools, turn)
    called_ms = now_ms()
    early = EagerDispatch(rt, state, turn, catalog) if tools and eager.wanted(rt, state) else None
    # Text of this turn already streamed to clients exists only if it ran before.
    seen = "" if first_attempt else turn_text(rt.redis, rt.keys, state.run_id, turn)
    reply = _complete(rt, state, turn, request, already_emitted=seen, early=early)
    if reply is None:
        return
    # With calls sent early, the rest are routed on the machines as those were.
    sent, fleet = (early.sent, early.fleet) if early is not None and early.sent else ({}, None)
    _take_reply(rt, state, turn, reply, catalog, sent, fleet, called_ms)


def _take_reply(
    rt: Runtime,
    state: RunState,
    turn: int,
    reply: ModelReply,
    catalog: list[ToolSpec],
    sent: Mapping[str, Dispatch],
    fleet: Fleet | None,
    called_ms: int,
) -> None:
    """Store the model's reply in the run and carry out what it asks for; `sent`: its
    calls already out (`coordinator.eager`), routed with `fleet`."""
    reply = _priced(reply, state.model, at_ms=called_ms)
    content, repairs = normalize_reply(reply.content, turn=turn, stop_reason=reply.stop_reason)
    state = state.model_copy(
        update={
            "turn": turn,
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
    _carry_out(rt, state, turn, step, catalog, sent, fleet)


def _carry_out(
    rt: Runtime,
    state: RunState,
    turn: int,
    step: DispatchTools | Finish | RetryOutput | Fail,
    catalog: list[ToolSpec],
    sent: Mapping[str, Dispatch],
    fleet: Fleet | None,
) -> None:
    cancel = rt.store.cancel_request(state.run_id)
    if (
        cancel is not None
        and sent
        and not must_stop_now(cancel, now_ms=now_ms(), deadline_ms=state.deadline_ms)
    ):
        # Calls sent early run on to their end; no other starts. The next turn ends the run.
        assert isinstance(step, DispatchTools)
        dispatch.dispatch_tools(
            rt, state, turn, step, catalog, sent=sent, unsent_cancelled=cancel.reason
        )
        return
    if cancel is not None:  # a boundary: after the model call, before dispatch
        why = f"cancelled ({cancel.reason})"
        outcomes = eager.answer_all(rt, state, turn, why) if sent else None  # calls out
        state = dispatch.close_open_calls(state, why, outcomes)
        stop_reason = cancel_stop_reason(cancel.reason)
        finish_cancelled(rt, state, cancel.channel, cancel.reason, stop_reason)
        return
    match step:
        case DispatchTools():
            dispatch.dispatch_tools(rt, state, turn, step, catalog, sent=sent, fleet=fleet)
        case Finish() if turn < state.max_turns and steers_pending(rt, state):
            # A message steered the run during this reply: answer it, do not finish. (On
            # the last turn it is answered by a follow-up run instead: `hand_on`.)
            rt.store.save(state)
            enqueue_turn(state.run_id, turn + 1)
        case Finish():
            finish_done(rt, state, step)
        case RetryOutput():
            retry = Message(role="user", content=step.message)
            update = {"history": [*state.history, retry], "output_retry_used": True}
            rt.store.save(state.model_copy(update=update))
            enqueue_turn(state.run_id, turn + 1)
        case Fail():
            finish_error(rt, state, step.kind, step.message)
        case _:
            assert_never(step)


def _priced(reply: ModelReply, requested: str, *, at_ms: int) -> ModelReply:
    """The reply with its cost: at the price of the model that answered (as the
    response names it), else of the one asked for."""
    from cmdop_worker.llm.pricing import has_price, priced

    model = reply.model if reply.model and has_price(reply.model) else requested
    return dataclasses.replace(reply, usage=priced(reply.usage, model, at_ms=at_ms))


def _is_direct(rt: Runtime, state: RunState) -> bool:
    from cmdop_worker.llm.client import model_client

    if not rt.settings.intent_router or has_tool_blocks(state.history):
        # The API refuses tool_use/tool_result blocks in a request without tools.
        return False
    model = rt.settings.resolve_model(rt.settings.router_model)
    answer = model_client(rt).classify(classifier_request(model, state.history), timeout_s=10.0)
    return parse_intent(answer) == "DIRECT"


def _catalog(rt: Runtime, state: RunState) -> list[ToolSpec]:
    presences = online_machines(rt.redis, rt.keys)
    return fleet_catalog(presences, tools.SPECS, state.request.machine)


def _build_request(
    rt: Runtime, state: RunState, tools: list[ToolSpec], turn: int
) -> dict[str, Any]:
    system = system_prompt(agent_prompt=state.system_prompt, platform=state.request.platform)
    reminder = turn_reminder(
        host=rt.host,
        target_machine=state.request.machine,
        has_tools=bool(tools),
        turn=turn,
        max_turns=state.max_turns,
    )
    return build_request(
        model=state.model,
        system=system,
        reminder=reminder,
        history=sanitize_history(state.history),
        tools=tools,
        temperature=rt.settings.temperature,
        max_tokens=rt.settings.max_tokens,
        thinking=state.thinking,
        cache_ttl=rt.settings.cache_ttl,
    )


def _within_context(rt: Runtime, state: RunState, turn: int) -> RunState:
    """`state` with old tool results cleared when its history is over the threshold."""
    clearing = clear_old_results(state.history, max_tokens=rt.settings.context_max_tokens)
    if not clearing.changed:
        return state
    log.info(
        "run %s turn %s: cleared %d old tool results, removed %d old messages (~%d -> ~%d tokens)",
        state.run_id,
        turn,
        clearing.cleared,
        clearing.dropped,
        clearing.tokens_before,
        clearing.tokens_after,
    )
    return state.model_copy(update={"history": clearing.history})


class _TurnSink:
    """Where a turn's model call reports: fragments and retries become events."""

    def __init__(self, rt: Runtime, run_id: str, turn: int) -> None:
        self.rt, self.run_id, self.turn = rt, run_id, turn

    def emit(self, kind: Any, text: str) -> None:
        self.rt.events.emit(self.run_id, kind, self.turn, {"text": text})

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
        data = {
            "attempt": notice.attempt,
            "delay_ms": int(notice.delay_s * 1000),
            "cause": notice.cause,
        }
        self.rt.events.emit(self.run_id, "RETRY", self.turn, data)


def _complete(
    rt: Runtime,
    state: RunState,
    turn: int,
    request: dict[str, Any],
    *,
    already_emitted: str,
    early: EagerDispatch | None,
) -> ModelReply | None:
    """The model's reply, or None when the run ended during the call."""
    from cmdop_worker.llm.client import model_client

    run_id = state.run_id
    stream = state.request.stream if state.request.stream is not None else rt.settings.stream
    sink = _TurnSink(rt, run_id, turn)
    state = state.model_copy(update={"turn": turn})  # if the run ends here, it ends in turn n
    deadline_s = time.monotonic() + (state.deadline_ms - now_ms()) / 1000
    started, outcome = time.monotonic(), "ok"
    with rt.hub.watch(run_id, state.deadline_ms) as watch:
        try:
            return model_client(rt).complete(
                request,
                stream=stream,
                emit=sink.emit,
                watch=watch,
                deadline_s=deadline_s,
                on_retry=sink.on_retry,
                already_emitted=already_emitted,
                fallbacks=state.fallback_models,
                on_block=early,
            )
        except StopNow as stop:
            outcome = "cancelled"
            cancel = watch.request or rt.store.cancel_request(run_id)
            channel = cancel.channel if cancel else "operation"
            reason = cancel.reason if cancel else "timeout"
            state = state.model_copy(update={"text": state.text + stop.partial_text})
            if early is not None:  # calls sent early: in history, answered
                state = early.closed_out(state, f"cancelled ({reason})")
            finish_cancelled(rt, state, channel, reason, cancel_stop_reason(reason))
        except ModelError as exc:
            outcome = "error"
            if early is not None:
                state = early.closed_out(state, f"not finished ({exc.kind})")
            if exc.kind == "deadline":
                finish_cancelled(rt, state, "operation", "timeout", "timeout")
            else:
                tried = f" (after {exc.attempts} attempts)" if exc.attempts else ""
                finish_error(rt, state, f"model_{exc.kind}", exc.message + tried)
        finally:
            metrics.MODEL_CALL_SECONDS.labels(outcome=outcome).observe(time.monotonic() - started)
    return None


def _last_text(state: RunState) -> str:
    for message in reversed(state.history):
        if message.role == "assistant":
            if isinstance(message.content, str):
                return message.content
            return "".join(b.get("text", "") for b in message.content if b.get("type") == "text")
    return ""
