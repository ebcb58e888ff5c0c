"""Eager dispatch: a streamed reply's tool calls start while the model is still writing.

A turn whose model call streams (and whose calls run in parallel) hands the model
client an `EarlySender` as its `on_block`. At each tool_use block's
`content_block_stop` it routes that one call as `calls.start_calls` would (the same
rules, the fleet as the turn read it once: `calls.FleetView`); a call routing sends to
a machine is held, and the held calls go out together at the first event that comes
`FLUSH_AFTER_S` after the first of them: at once while the model is still writing,
never for a reply that came in one burst (it is sent whole at its end, in one round
trip).
A call that is refused, repaired or run by the coordinator waits for the whole reply,
and `calls.start_calls` treats it as any other, given the calls already sent
(`sent`), which it neither routes nor sends again. The machine's gate, its parking of
an "ask" and its refusals apply unchanged: the call it gets is the same message.

Safety:

- Before a call goes out, the reply as far as it is whole and the calls sent so far
  are stored (`state.eager`), fenced by the turn's lease and refused once the run has
  a cancel request. So a stale executor sends nothing, and no call starts eagerly
  after a cancel was asked for.
- Once a call went out, the model call is committed to that reply: a stream that
  fails later is not retried, and the turn goes on with the whole blocks received
  (`ReplyStream.partial_reply`), their sent calls answered by their results.
- A turn executed again after its executor died (`resume`) does not ask the model
  again: it takes the stored reply, whatever else holds (a cancel, the deadline, the
  turn's attempts spent: each ends or goes on as it would after that reply), and of
  its sent calls sends again only those that neither started nor have an outcome (as
  recovery does), so none runs twice. It takes only the steering messages the reply
  was written after; later ones wait for the next boundary.
- A ui cancel (or the deadline) during the stream ends the run with the sent part of
  the reply in history, each of its calls answered by its outcome if it has one, else
  as cancelled, with its TOOL_END (`closed_out`, `answer_all`). An operation cancel
  lets the sent calls finish and starts no other: they are answered "cancelled …
  before it started".
- A failure of sending itself (not the model's) fails the turn, which the watchdog
  executes again: it resumes the stored reply, or asks anew when nothing went out.

`CMDOP_EAGER_DISPATCH=false` turns it off; with streaming off there is nothing to do
early.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cmdop_worker import tracing
from cmdop_worker.coordinator import calls
from cmdop_worker.core.results import Call, unanswered
from cmdop_worker.core.routing import ToMachine, route_call
from cmdop_worker.core.step import ModelReply, normalize_reply
from cmdop_worker.models import Message, ToolOutcome
from cmdop_worker.outcomes import record
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.eager import EagerRecords, EagerReply, SentCall
from cmdop_worker.state.store import RunState

log = logging.getLogger(__name__)

# Calls whose blocks closed are held back until an event of the stream comes this long
# after the first of them: a reply arriving in one burst (its events already read) is
# then dispatched whole, in one round trip, with nothing sent early to pay for; a reply
# still being written sends them at its next event.
FLUSH_AFTER_S = 0.005


def records(rt: Runtime) -> EagerRecords:
    return rt.service("eager", lambda _: EagerRecords(rt.redis, rt.keys, ttl_s=rt.store.ttl_s))


def wanted(rt: Runtime, state: RunState) -> bool:
    """Whether this run's turns send calls on while the reply streams."""
    stream = state.request.stream if state.request.stream is not None else rt.settings.stream
    return stream and rt.settings.eager_dispatch and state.parallel_tools


class EarlySender:
    """A turn's `on_block`: each whole tool call bound for a machine goes there now."""

    def __init__(self, rt: Runtime, state: RunState, turn: int, view: calls.FleetView) -> None:
        self.rt, self.state, self.turn = rt, state, turn
        self.rules = calls.routing_rules(rt, state, view)
        self.fleet = view.fleet
        self.headers = tracing.trace_headers()
        self.sent: dict[str, ToMachine] = {}
        self.content: list[dict[str, Any]] = []  # the whole blocks as of the last call sent
        self._ids: set[str] = set()
        self._held: list[ToMachine] = []  # whole calls not sent yet, in the model's order
        self._held_since = 0.0
        self._stopped = False  # the run has a cancel request: nothing more goes out early

    def __call__(self, block: dict[str, Any] | None, partial: Callable[[], ModelReply]) -> bool:
        """One event of the stream: the calls held back go out once the stream pauses."""
        now = time.monotonic()
        if block is not None and not self._stopped:
            self._hold(block, now)
        if not self._held or now - self._held_since < FLUSH_AFTER_S:
            return False
        return self._send_held(partial())

    def _hold(self, block: dict[str, Any], now: float) -> None:
        """Hold back a whole call that routing sends to a machine."""
        tool_use_id = block.get("id")
        if block.get("type") != "tool_use" or not isinstance(tool_use_id, str):
            return
        if not tool_use_id or tool_use_id in self._ids:
            return  # repaired (and answered) once the reply is complete
        self._ids.add(tool_use_id)
        route = route_call(block, self.rules, self.fleet, now_ms())
        if isinstance(route, ToMachine):  # refused, or a coordinator's: at the reply's end
            self._held_since = self._held_since if self._held else now
            self._held.append(route)

    def _send_held(self, partial: ModelReply) -> bool:
        """Store the reply as far as it is whole, then send the held calls together."""
        held, self._held = self._held, []
        stored = EagerReply(
            content=partial.content,
            sent=[SentCall(**dataclasses.asdict(r)) for r in [*self.sent.values(), *held]],
            usage=partial.usage,
            model=partial.model,
            steers_applied=self.state.steers_applied,
        )
        if not records(self.rt).store(self.state.run_id, self.turn, stored):
            self._stopped = True  # a cancel: nothing more goes out early
            return False
        grace_ms = self.rules.grace_ms
        calls.send_to_machines(self.rt, self.state, self.turn, held, grace_ms, self.headers)
        self.sent.update((r.tool_use_id, r) for r in held)
        self.content = partial.content
        log.debug("run %s turn %s: %d calls sent early", self.state.run_id, self.turn, len(held))
        return True

    def closed_out(self, state: RunState, why: str) -> RunState:
        """`state` with the sent part of the reply as the assistant's message and each of
        its calls answered (`answer_all`)."""
        if not self.sent:
            return state
        return closed(self.rt, state, self.turn, self.content, why)


def closed(
    rt: Runtime, state: RunState, turn: int, content: list[dict[str, Any]], why: str
) -> RunState:
    """`state` with `content` (a reply whose calls went out) as the assistant's message
    and each of its calls answered (`answer_all`): for a run that ends now."""
    content, _ = normalize_reply(content, turn=turn)
    reply = Message(role="assistant", content=content)
    with_reply = state.model_copy(update={"turn": turn, "history": [*state.history, reply]})
    outcomes = answer_all(rt, with_reply, turn, why)
    return calls.close_open_calls(with_reply, why, outcomes)


def answer_all(rt: Runtime, state: RunState, turn: int, why: str) -> dict[str, ToolOutcome]:
    """The outcomes of the calls of `state`'s last (assistant) message, for a turn that
    ends with calls out: each call without one is answered now with `why` (cancelled),
    its TOOL_END written, so no call that started is left without one. A machine's
    outcome stored first wins."""
    last = state.history[-1].content if state.history else ""
    blocks = [b for b in last if b.get("type") == "tool_use"] if isinstance(last, list) else []
    stored = rt.store.outcomes(state.run_id, turn)
    for block in blocks:
        if block["id"] not in stored:
            outcome = unanswered(Call(block["id"], block["name"]), "cancelled", why)
            record(rt, state.run_id, turn, outcome, tool_input=block.get("input", {}))
    return rt.store.outcomes(state.run_id, turn)


@dataclass(frozen=True)
class Resumed:
    """The reply of a turn whose executor died after sending calls early."""

    reply: ModelReply
    kept: dict[str, ToMachine]  # its calls not to send again: started, or answered
    steers_applied: int  # the steering messages it was written after


def resume(rt: Runtime, run_id: str, turn: int) -> Resumed | None:
    """The stored reply of a turn that sent calls early; None: none went out."""
    saved = records(rt).load(run_id, turn)
    if saved is None:
        return None
    answered = rt.store.outcomes(run_id, turn)
    kept = {
        c.tool_use_id: ToMachine(c.tool_use_id, c.tool, c.machine, c.input, c.deadline_ms)
        for c in saved.sent
        if c.tool_use_id in answered or rt.store.was_started(run_id, c.tool_use_id)
    }
    log.warning(
        "run %s: turn %s sent %d calls before its executor stopped; going on with that reply",
        run_id,
        turn,
        len(saved.sent),
    )
    reply = ModelReply(saved.content, "tool_use", saved.usage, model=saved.model)
    return Resumed(reply, kept, saved.steers_applied)
