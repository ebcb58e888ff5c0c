"""A turn's tool calls: sending them out, recording outcomes, collecting them back.

The turn task calls `dispatch_tools` once the model asked for tools: it routes every
call (pure `core.routing`), stores the turn's pending calls and the barrier's expected
count, answers refused calls at once, runs coordinator tools, and sends the rest to
their machines' queues, all at once, each recorded as sent first (`state.sent`: a
machine runs no call without its record). A sequential turn (`parallel_tools=false`) stores
its calls in order with the barrier instead (`QueuedCall`s, each with its own timeout)
and starts only the first: whoever records a call's outcome sends the next
(`outcomes.record`), refused calls and coordinator tools included, so they all run in
the model's order, each with its deadline counted from when it is sent. It also
registers the turn's deadline with the watchdog, so a turn always ends.

Every outcome enters a turn through `outcomes.record`. `collect_outcomes` turns the
stored outcomes into the user message of tool results, in the order of the calls, and
adds what they spent on the model (an ask's child runs) to the run's usage.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from cmdop_worker import tracing
from cmdop_worker.coordinator import local_tools
from cmdop_worker.core import tools
from cmdop_worker.core.routing import (
    Dispatch,
    Fleet,
    Refuse,
    Route,
    RoutingRules,
    RunLocally,
    own_timeout_ms,
    route_calls,
    sequential_deadlines,
)
from cmdop_worker.core.step import DispatchTools
from cmdop_worker.messages import enqueue_turn, publish, tool_message
from cmdop_worker.models import Message, ToolCall, ToolOutcome, ToolSpec
from cmdop_worker.outcomes import record, send_tool_call
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.keys import turn_member
from cmdop_worker.state.presence import online_machines
from cmdop_worker.state.sent import mark_sent
from cmdop_worker.state.store import PendingCall, QueuedCall, RunState

log = logging.getLogger(__name__)


def dispatch_tools(
    rt: Runtime,
    state: RunState,
    turn: int,
    step: DispatchTools,
    catalog: list[ToolSpec],
    *,
    sent: Mapping[str, Dispatch] | None = None,
    unsent_cancelled: str | None = None,
    fleet: Fleet | None = None,
) -> None:
    """`sent`: calls already sent on, with their routes (`coordinator.eager`): kept as
    they are, never sent again. `unsent_cancelled`: the reason of an operation cancel
    that came while they ran; every other call is answered as cancelled before it started.
    `fleet`: the machines as read for this reply already (by eager dispatch), else now."""
    sent = sent or {}
    rules, now = routing_rules(rt, state, catalog), now_ms()
    routes = [
        sent.get(r.tool_use_id, r)
        for r in route_calls(step.tool_uses, rules, fleet or fleet_now(rt), now)
    ]
    timeouts = {r.tool_use_id: own_timeout_ms(r, rules, now) for r in routes}
    if not state.parallel_tools:
        routes = sequential_deadlines(routes, rules, now)
    routes = [
        _refused(r, step.repairs, unsent_cancelled) if r.tool_use_id not in sent else r
        for r in routes
    ]
    pending = [
        PendingCall(
            tool_use_id=r.tool_use_id,
            tool=r.tool,
            machine=getattr(r, "machine", None),
            deadline_ms=getattr(r, "deadline_ms", now_ms()),
        )
        for r in routes
    ]
    machine_calls = [r for r in routes if isinstance(r, Dispatch)]
    unsent = [r for r in machine_calls if r.tool_use_id not in sent]
    # The turn's deadline, and while calls are out on machines, their presence probe.
    entries = {turn_member(state.run_id, turn): max(p.deadline_ms for p in pending)}
    if machine_calls:
        from cmdop_worker.coordinator.liveness import probe_entry

        entries.update([probe_entry(rt, state.run_id, turn)])
    inputs = {t["id"]: t.get("input") for t in step.tool_uses}
    headers = tracing.trace_headers()  # the tool spans' parent: this turn's span
    sequence = []
    if not state.parallel_tools:
        sequence = [
            _queued(state, turn, r, inputs, rules.grace_ms, headers, timeouts[r.tool_use_id])
            for r in routes
        ]
    saved = state.model_copy(update={"awaiting": pending})
    # Every machine call of a sequential turn is recorded as sent now: the writer of a
    # call's outcome hands the next one out, a machine too, and machines write no records.
    mark_sent(rt.redis, rt.keys, [q.call for q in sequence if q.call], ttl_s=rt.store.ttl_s)
    opened = rt.store.open_turn(
        state.run_id, turn, len(routes), save=saved, sequence=sequence, schedule=entries
    )
    if opened:
        enqueue_turn(state.run_id, turn + 1)  # every outcome was in before the count
    if sequence:
        _start_first(rt, state, turn, routes[0], sequence[0])
        return
    send_calls(rt, state, turn, unsent, rules.grace_ms, headers)  # first: machines start
    for route in routes:
        if isinstance(route, Refuse):
            outcome = _refusal(route)
            record(rt, state.run_id, turn, outcome, tool_input=inputs.get(route.tool_use_id))
        elif isinstance(route, RunLocally):
            local_tools.run_local(rt, state, turn, route)


def _refused(route: Route, repairs: Mapping[str, str], cancelled: str | None) -> Route:
    """The call's route, or its refusal: repaired (not runnable), or a cancel's."""
    if route.tool_use_id in repairs:
        return Refuse(route.tool_use_id, route.tool, "invalid", repairs[route.tool_use_id])
    if cancelled is not None and not isinstance(route, Refuse):
        # No machine: recovery, finding it unanswered, must not send it there.
        why = f"cancelled ({cancelled}) before it started"
        return Refuse(route.tool_use_id, route.tool, "cancelled", why)
    return route


def _refusal(route: Refuse) -> ToolOutcome:
    return ToolOutcome(
        tool_use_id=route.tool_use_id,
        tool=route.tool,
        machine=route.machine,
        status=route.status,
        output=route.message,
    )


def _queued(
    state: RunState,
    turn: int,
    route: Route,
    inputs: dict[str, Any],
    grace_ms: int,
    headers: dict[str, str],
    timeout_ms: int = 0,
) -> QueuedCall:
    """A sequential turn's call as stored until its turn comes: with its own timeout,
    from which its deadline is set when it is sent (`QueuedCall.handed_out`)."""
    if isinstance(route, Refuse):
        raw = inputs.get(route.tool_use_id)
        answer = _refusal(route)
        return QueuedCall(
            tool_use_id=route.tool_use_id, tool=route.tool, send="answer", input=raw, answer=answer
        )
    call = _tool_call(state, turn, route, grace_ms) if isinstance(route, Dispatch) else None
    return QueuedCall(
        tool_use_id=route.tool_use_id,
        tool=route.tool,
        send="coordinator" if call is None else "machine",
        input=route.input if call is None else call.input,
        call=call,
        deadline_ms=route.deadline_ms,
        headers=headers,
        timeout_ms=timeout_ms,
        run_deadline_ms=state.deadline_ms,
        grace_ms=grace_ms,
    )


def _start_first(rt: Runtime, state: RunState, turn: int, route: Route, first: QueuedCall) -> None:
    """Start a sequential turn's first call; the rest follow one by one as each is
    answered (`outcomes.record`)."""
    if isinstance(route, RunLocally):
        local_tools.run_local(rt, state, turn, route)
    elif first.answer is not None:
        record(rt, state.run_id, turn, first.answer, tool_input=first.input)
    else:
        send_tool_call(state.run_id, turn, first)


def send_calls(
    rt: Runtime,
    state: RunState,
    turn: int,
    calls: list[Dispatch],
    grace_ms: int,
    headers: dict[str, str],
) -> None:
    # Recorded as sent (their machines run nothing else), then all published in one
    # round trip (`publish`): one Redis pipeline, or one AMQP channel.
    machine_calls = [_tool_call(state, turn, call, grace_ms) for call in calls]
    mark_sent(rt.redis, rt.keys, machine_calls, ttl_s=rt.store.ttl_s)
    publish([tool_message(call, headers) for call in machine_calls])


def _tool_call(state: RunState, turn: int, call: Dispatch, grace_ms: int) -> ToolCall:
    return machine_call(
        state,
        turn,
        call.tool_use_id,
        call.tool,
        call.machine,
        call.input,
        watchdog_deadline_ms=call.deadline_ms,
        grace_ms=grace_ms,
    )


def machine_call(
    state: RunState,
    turn: int,
    tool_use_id: str,
    tool: str,
    machine: str,
    tool_input: dict[str, Any],
    *,
    watchdog_deadline_ms: int,
    grace_ms: int,
) -> ToolCall:
    """The message a machine gets for a call (dispatched, or re-sent by recovery)."""
    # The machine must be done by the call's own deadline; the grace after it is the
    # watchdog's, so a tool's own timeout is reported as such, not as a lost machine.
    return ToolCall(
        run_id=state.run_id,
        turn=turn,
        tool_use_id=tool_use_id,
        tool=tool,
        machine=machine,
        input=tool_input,
        deadline_ms=min(watchdog_deadline_ms - grace_ms, state.deadline_ms),
        run_deadline_ms=state.deadline_ms,
    )


def routing_rules(rt: Runtime, state: RunState, catalog: list[ToolSpec]) -> RoutingRules:
    from cmdop_worker.core.catalog import hidden_tools

    hidden = hidden_tools(rt.hide_map, state.request.platform, state.request.mode)
    known = {spec.name for spec in catalog} | tools.BUILTIN_MACHINE_TOOLS
    return RoutingRules(
        visible=frozenset(known - hidden),
        known=frozenset(known),
        coordinator_tools=tools.NAMES,
        target_machine=state.request.machine,
        default_timeout_ms=rt.settings.tool_timeout_ms,
        grace_ms=rt.settings.tool_grace_ms,
        run_deadline_ms=state.deadline_ms,
        timeout_args={
            "execute_command": ("timeout_ms", rt.settings.tool_timeout_ms),
            **tools.TIMEOUT_ARGS,
        },
    )


def fleet_now(rt: Runtime) -> Fleet:
    presences = online_machines(rt.redis, rt.keys)
    offered: dict[str, set[str]] = {}
    for presence in presences:
        for spec in presence.tools:
            offered.setdefault(spec.name, set()).add(presence.machine)
    return Fleet(
        offered={tool: frozenset(ms) for tool, ms in offered.items()},
        online=frozenset(p.machine for p in presences),
    )


def collect_outcomes(rt: Runtime, state: RunState) -> RunState:
    """Append the finished turn's results to history, in the order of the calls."""
    stored = rt.store.outcomes(state.run_id, state.turn)
    blocks, usage = [], state.usage
    for call in state.awaiting:
        outcome = stored.get(call.tool_use_id) or ToolOutcome(
            tool_use_id=call.tool_use_id,
            tool=call.tool,
            machine=call.machine,
            status="lost",
            output="no result was recorded for this call",
        )
        blocks.append(result_block(outcome))
        if outcome.usage is not None:  # an ask's child runs: their spend is the run's
            usage = usage + outcome.usage
    rt.store.unschedule(turn_member(state.run_id, state.turn))
    history = [*state.history, Message(role="user", content=blocks)]
    return state.model_copy(update={"history": history, "awaiting": [], "usage": usage})


def result_block(outcome: ToolOutcome) -> dict[str, Any]:
    block: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": outcome.tool_use_id,
        "content": outcome.output or "(no output)",
    }
    if outcome.is_error:
        block["is_error"] = True
    return block


def close_open_calls(
    state: RunState, why: str, outcomes: Mapping[str, ToolOutcome] | None = None
) -> RunState:
    """Answer every tool call of the last assistant message: by its stored outcome, for
    a call that has one (sent early: `coordinator.eager`), else with `why` (an error)."""
    last = state.history[-1] if state.history else None
    if last is None or last.role != "assistant" or isinstance(last.content, str):
        return state
    outcomes = outcomes or {}
    blocks = [
        result_block(
            outcomes.get(b["id"])
            or ToolOutcome(tool_use_id=b["id"], tool=b["name"], status="cancelled", output=why)
        )
        for b in last.content
        if b.get("type") == "tool_use"
    ]
    if not blocks:
        return state
    return state.model_copy(
        update={"history": [*state.history, Message(role="user", content=blocks)], "awaiting": []}
    )
