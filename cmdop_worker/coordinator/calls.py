"""A turn's tool calls on the coordinator, from the model's reply to the results it
reads: route, send, answer, collect. Start here.

The turn reads the fleet once (`read_fleet`): the model's catalogue and the routing of
its calls both come from that one read. Once the model asked for tools, the turn calls
`start_calls`:

1. Route every call (pure `core.routing.reply_routes`): `ToMachine`, `ToCoordinator`,
   or `Refused` (unknown, hidden, badly addressed, offline; also a call the reply
   repaired, and after an operation cancel every call not sent early). A call given
   `machines` (a selector) is in its copies' place: one `ToMachine` per matching
   machine, each an ordinary call under its own id (`core.fanout.copy_id`), so the
   barrier counts copies, each starts at most once, and recovery, the watchdog and
   liveness treat each as any call; `collect_results` gives the model one result for
   them all. Given the request's `serial`, a parallel turn sends only each fan-out's
   first batch; the barrier keeps the rest, and whoever ends a batch sends the next
   (`outcomes.send_batch`).
2. Open the turn: its pending calls (`RunState.awaiting`), the barrier's expected
   count, the turn's deadline with the watchdog and, while calls are out on machines,
   their presence probe (`liveness`).
3. Send. A parallel turn sends its machine calls all at once (`send_to_machines`: each
   recorded as sent first, `state.sent`, since a machine runs no call without its
   record; then one round trip, `messages.publish`), answers its refused calls and runs its
   coordinator tools (`local_tools`). A sequential turn (`parallel_tools=false`)
   stores its calls in order with the barrier and starts only the first; whoever
   records a call's outcome sends the next (`outcomes.record` through
   `outcomes.send_in_order`, shared with the machines), so they run in the model's
   order, each with its deadline counted from when it is sent.
4. Answer. Every outcome enters through `outcomes.record`: a machine's, a refusal, a
   coordinator tool's, or one written for a call its tool never answered
   (`core.results.unanswered_outcome`: the watchdog, `liveness`, `recovery`, a parked
   call's expiry). The writer whose outcome completes the turn enqueues the next.
5. Collect. The next turn starts with `collect_results`: the outcomes as one user
   message of tool results, in the order of the calls. A run that ends with calls
   open answers them instead (`close_open_calls`).

Calls may also go out while the reply still streams (`eager`, through the routing and
sending here), and `recovery` finishes the sending of a turn whose executor died.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from cmdop_worker import tracing
from cmdop_worker.coordinator import local_tools
from cmdop_worker.coordinator.liveness import probe_entry
from cmdop_worker.core import fanout, tools
from cmdop_worker.core.catalog import fleet_catalog, hidden_tools
from cmdop_worker.core.fanout import DEFAULT_MAX_FANOUT, copy_inputs
from cmdop_worker.core.results import closing_message, collected, unanswered
from cmdop_worker.core.routing import (
    Fleet,
    Refused,
    Route,
    RoutingRules,
    ToCoordinator,
    ToMachine,
    fleet_of,
    reply_routes,
)
from cmdop_worker.core.step import RunTools
from cmdop_worker.messages import enqueue_turn, publish, tool_message
from cmdop_worker.models import ToolCall, ToolOutcome, ToolSpec
from cmdop_worker.outcomes import record, send_tool_call
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.keys import turn_member
from cmdop_worker.state.presence import FleetSnapshot, fleet_snapshot
from cmdop_worker.state.sent import mark_sent
from cmdop_worker.state.store import PendingCall, QueuedCall, RunState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetView:
    """The fleet as a turn read it, once: the model's catalogue and the routing of its
    calls both use this read."""

    catalog: list[ToolSpec]
    hidden: frozenset[str]  # by the hide map, for the run's platform and mode
    fleet: Fleet


def read_fleet(rt: Runtime, state: RunState) -> FleetView:
    """The fleet for this turn: O(1) Redis work and no rebuilding while no machine joined,
    left or changed (`state.presence.fleet_snapshot` keeps the presences by the fleet's
    version; the catalogue and the routing view are kept per snapshot here)."""
    catalog, fleet = _derived(fleet_snapshot(rt.redis, rt.keys))
    return FleetView(
        catalog=list(catalog),
        hidden=hidden_tools(rt.hide_map, state.request.platform, state.request.mode),
        fleet=fleet,
    )


# The last snapshot's catalogue and routing view (the snapshot is held, so its id is not
# reused): a turn on an unchanged fleet does no work proportional to its size.
_last_derived: list[tuple[FleetSnapshot, tuple[ToolSpec, ...], Fleet]] = []


def _derived(snapshot: FleetSnapshot) -> tuple[tuple[ToolSpec, ...], Fleet]:
    for seen, catalog, fleet in _last_derived:
        if seen is snapshot:
            return catalog, fleet
    catalog = tuple(fleet_catalog(snapshot.presences, tools.SPECS))
    fleet = fleet_of(snapshot.presences, known=snapshot.known)
    _last_derived[:] = [(snapshot, catalog, fleet), *_last_derived[:3]]
    return catalog, fleet


def routing_rules(rt: Runtime, state: RunState, view: FleetView) -> RoutingRules:
    known = {spec.name for spec in view.catalog} | tools.BUILTIN_MACHINE_TOOLS
    return RoutingRules(
        visible=frozenset(known - view.hidden),
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
        max_fanout=fanout_limits(rt, state)[0],
        copy_key=state.copy_key,
    )


def fanout_limits(rt: Runtime, state: RunState) -> tuple[int, int | None]:
    """A fan-out's `max_fanout` and batch size (`serial`): the request's, else its
    agent profile's."""
    agent = rt.agents.get(state.request.agent)
    max_fanout = agent.max_fanout if agent is not None else DEFAULT_MAX_FANOUT
    serial = agent.serial if agent is not None else None
    return state.request.max_fanout or max_fanout, state.request.serial or serial


def start_calls(
    rt: Runtime,
    state: RunState,
    turn: int,
    step: RunTools,
    view: FleetView,
    *,
    sent: Mapping[str, ToMachine] | None = None,
    unsent_cancelled: str | None = None,
) -> None:
    """Route, open and send the turn's calls (the module docstring). `sent`: calls
    already sent while the reply streamed (`eager`), with their routes: kept as they
    are, never sent again. `unsent_cancelled`: the reason of an operation cancel that
    came while they ran; every other call is answered as cancelled before it started."""
    sent = sent or {}
    rules, now = routing_rules(rt, state, view), now_ms()
    routes, timeouts = reply_routes(
        step.tool_uses,
        step.repairs,
        rules,
        view.fleet,
        now,
        sent=sent,
        cancelled=unsent_cancelled,
        sequential=not state.parallel_tools,
    )
    inputs = {t["id"]: t.get("input") for t in step.tool_uses}
    inputs.update(copy_inputs(inputs, [r.tool_use_id for r in routes]))  # a fan-out's copies
    headers = tracing.trace_headers()  # the tool spans' parent: this turn's span
    if not state.parallel_tools:
        sequence = [
            _queued(state, turn, r, inputs, rules.grace_ms, headers, timeouts[r.tool_use_id])
            for r in routes
        ]
        _open_turn(rt, state, turn, routes, sequence)
        _start_first(rt, state, turn, routes[0], sequence[0])
        return
    routes, waiting = _batched(rt, state, turn, routes, inputs, headers, timeouts, now)
    _open_turn(rt, state, turn, routes, [])
    unsent = [
        r
        for r in routes
        if isinstance(r, ToMachine) and r.tool_use_id not in sent and r.tool_use_id not in waiting
    ]
    send_to_machines(rt, state, turn, unsent, rules.grace_ms, headers)  # first: machines start
    _answer_here(rt, state, turn, routes, inputs)


def _batched(
    rt: Runtime,
    state: RunState,
    turn: int,
    routes: list[Route],
    inputs: Mapping[str, Any],
    headers: dict[str, str],
    timeouts: Mapping[str, int],
    now: int,
) -> tuple[list[Route], set[str]]:
    """A parallel turn's fan-outs cut into batches of the request's `serial`: each
    copy's deadline planned after the batches before it, the copies of later batches
    stored with the barrier (and recorded as sent: whoever ends a batch sends the next,
    a machine too) and returned, not to be sent now."""
    ids = [r.tool_use_id for r in routes if isinstance(r, ToMachine)]
    plan = fanout.batches(ids, fanout_limits(rt, state)[1])
    if not plan:
        return routes, set()
    number, grace_ms = fanout.batch_number(plan), rt.settings.tool_grace_ms
    routes = [
        replace(
            r, deadline_ms=min(now + (number[i] + 1) * timeouts[i], state.deadline_ms) + grace_ms
        )
        if (i := r.tool_use_id) in number and isinstance(r, ToMachine)
        else r
        for r in routes
    ]
    waiting = {i for i, n in number.items() if n > 0}
    queued = [
        _queued(state, turn, r, dict(inputs), grace_ms, headers, timeouts[r.tool_use_id])
        for r in routes
        if r.tool_use_id in waiting
    ]
    mark_sent(rt.redis, rt.keys, [q.call for q in queued if q.call], ttl_s=rt.store.ttl_s)
    rt.store.store_batches(state.run_id, turn, plan, queued)
    return routes, waiting


def _answer_here(
    rt: Runtime, state: RunState, turn: int, routes: list[Route], inputs: Mapping[str, Any]
) -> None:
    """Answer a parallel turn's refused calls and run its coordinator tools."""
    for route in routes:
        if isinstance(route, Refused):
            record(rt, state.run_id, turn, refusal(route), tool_input=inputs.get(route.tool_use_id))
        elif isinstance(route, ToCoordinator):
            local_tools.run_local(rt, state, turn, route)


def _open_turn(
    rt: Runtime, state: RunState, turn: int, routes: list[Route], sequence: list[QueuedCall]
) -> None:
    """Store the turn's pending calls with the barrier's count (a sequential turn's
    order too), its deadline and, with calls on machines, their probe. When every
    outcome was in before the count (calls sent early), the next turn goes now."""
    at_ms = now_ms()
    pending = [
        PendingCall(
            tool_use_id=r.tool_use_id,
            tool=r.tool,
            machine=r.machine,
            deadline_ms=at_ms if isinstance(r, Refused) else r.deadline_ms,
        )
        for r in routes
    ]
    entries = {turn_member(state.run_id, turn): max(p.deadline_ms for p in pending)}
    if any(isinstance(r, ToMachine) for r in routes):
        entries.update([probe_entry(rt, state.run_id, turn)])
    saved = state.model_copy(update={"awaiting": pending})
    # Every machine call of a sequential turn is recorded as sent now: the writer of a
    # call's outcome hands the next one out, a machine too, and machines write no records.
    mark_sent(rt.redis, rt.keys, [q.call for q in sequence if q.call], ttl_s=rt.store.ttl_s)
    if rt.store.open_turn(
        state.run_id, turn, len(routes), save=saved, sequence=sequence, schedule=entries
    ):
        enqueue_turn(state.run_id, turn + 1)


def refusal(route: Refused) -> ToolOutcome:
    return unanswered(route, route.status, route.message)


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
    if isinstance(route, Refused):
        raw, answer = inputs.get(route.tool_use_id), refusal(route)
        return QueuedCall(
            tool_use_id=route.tool_use_id, tool=route.tool, send="answer", input=raw, answer=answer
        )
    call = machine_call(state, turn, route, grace_ms) if isinstance(route, ToMachine) else None
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
    if isinstance(route, ToCoordinator):
        local_tools.run_local(rt, state, turn, route)
    elif first.answer is not None:
        record(rt, state.run_id, turn, first.answer, tool_input=first.input)
    else:
        send_tool_call(first)


def send_to_machines(
    rt: Runtime,
    state: RunState,
    turn: int,
    routes: list[ToMachine],
    grace_ms: int,
    headers: dict[str, str],
) -> None:
    """Send calls routed to machines: each recorded as sent (its machine runs nothing
    else), then all published in one round trip (one Redis pipeline, or one AMQP channel)."""
    publish_calls(rt, [machine_call(state, turn, r, grace_ms) for r in routes], headers)


def publish_calls(rt: Runtime, calls: list[ToolCall], headers: dict[str, str]) -> None:
    mark_sent(rt.redis, rt.keys, calls, ttl_s=rt.store.ttl_s)
    publish([tool_message(call, headers) for call in calls])


def machine_call(state: RunState, turn: int, route: ToMachine, grace_ms: int) -> ToolCall:
    """The message a machine gets for a call (sent now, or again by recovery)."""
    # The machine must be done by the call's own deadline; the grace after it is the
    # watchdog's, so a tool's own timeout is reported as such, not as a lost machine.
    return ToolCall(
        run_id=state.run_id,
        turn=turn,
        tool_use_id=route.tool_use_id,
        tool=route.tool,
        machine=route.machine,
        input=route.input,
        deadline_ms=min(route.deadline_ms - grace_ms, state.deadline_ms),
        run_deadline_ms=state.deadline_ms,
    )


def collect_results(rt: Runtime, state: RunState) -> RunState:
    """The finished turn's results appended to history, in the order of the calls, and
    what they spent on the model added to the run's usage."""
    stored = rt.store.outcomes(state.run_id, state.turn)
    message, usage = collected(state.awaiting, stored, state.usage)
    rt.store.unschedule(turn_member(state.run_id, state.turn))
    history = [*state.history, message]
    return state.model_copy(update={"history": history, "awaiting": [], "usage": usage})


def close_open_calls(
    state: RunState, why: str, outcomes: Mapping[str, ToolOutcome] | None = None
) -> RunState:
    """Answer every tool call of the last assistant message: by its stored outcome, for
    a call that has one (sent early: `eager`), else with `why` (cancelled)."""
    message = closing_message(state.history, why, outcomes or {})
    if message is None:
        return state
    return state.model_copy(update={"history": [*state.history, message], "awaiting": []})
