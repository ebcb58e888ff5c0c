"""The coordinator's watchdog: no turn hangs, no cancel waits.

Runs as a thread in every coordinator process. Entries live in one sorted set
(`<prefix>deadlines`, score = due time in ms); `claim_due` hands each to exactly one
coordinator, so any number of them may run. A claim is a lease, not a removal: the
entry is moved a lease ahead and removed once handled, so an entry whose coordinator
died while handling it comes due again. Every handler is idempotent.

- `turn:<run>:<n>` — the turn's deadline: every call still without an outcome gets one
  ("lost: started; outcome unknown; machine lost" when a machine had begun it, "timeout"
  when none picked it up: `core.results.unanswered_outcome`), and the turn advances.
- `run:<run>` — the run's deadline: a cancel with reason `timeout` is written (unless a
  request is there already: a ui cancel stays ui), which work in progress honours at
  once because the deadline has passed.
- `cancel:<run>` — a cancel request, as the fallback to the pushed copy that
  `on_cancel` handles the moment it is published.
- `probe:<run>:<n>` — while turn n has calls on machines: answer those whose machine
  has gone (`liveness`).
- `advance:<run>:<n>` — turn n may start but nobody is carrying it out: the enqueue
  was lost or its executor died (`recovery.resume_turn`).
- `start:<run>` — a client's `cmdop.run` no coordinator has handled a grace after it
  was sent: it may have been lost on its way, so it is sent again (`state.starts`).
- `approval:<run>:<tuid>` — a parked call nobody answered in time: it is denied; or one
  whose answer its machine has not taken: the task carrying it is sent again
  (`approvals.parked_due`). A turn's deadline waits for its parked calls: for their
  wait, and once approved for their own deadline (`approvals.parked_hold_ms`).

On a cancel that must be honoured now (ui, or past the deadline), the calls still
pending get "cancelled" outcomes, so the turn advances and ends the run at once, even
while a machine is busy or gone; child runs are cancelled too.

No handler takes an entry's score for proof that it is due: machines may write the
set (to hand a turn's deadline past a call they were handed), so a machine could
move any entry to 0. A `run:` or `turn:` entry come due before the stored deadline
(the run's; its calls' own, or a parked call's hold) is put back at it, as is an
`approval:` one before the parked call's expiry (`state.approvals` judges it); a
probe declares a machine lost only a presence TTL after its stored first miss; an
`advance:` entry waits while the turn's lock is held and is dropped while the turn
before has a call without an outcome; `cancel:` acts on a stored request only, and
`start:` on the stored send time.

The set has no TTL, on purpose. A running run's record has none either, and its
entries here are what end it (its deadline above all): with a TTL, a fleet down for
longer than that would come back to runs that never end. A live fleet empties the set
(each entry is removed once handled); only a fleet gone for good leaves entries
behind, which is why `cmdop-worker demo` deletes its whole key prefix on exit.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from cmdop_worker.coordinator.approvals import close_parked, parked_due, parked_hold_ms
from cmdop_worker.coordinator.liveness import probe_machines
from cmdop_worker.coordinator.local_tools import cancel_children
from cmdop_worker.coordinator.recovery import resume_turn
from cmdop_worker.core.results import Unanswered, unanswered_outcome
from cmdop_worker.messages import send_start
from cmdop_worker.models import CancelRequest
from cmdop_worker.outcomes import record
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state import starts
from cmdop_worker.state.cancel import must_stop_now
from cmdop_worker.state.connect import RedisError
from cmdop_worker.state.outage import OUTAGE
from cmdop_worker.state.store import tool_inputs

log = logging.getLogger(__name__)


def fill_missing(
    rt: Runtime, run_id: str, turn: int, situation: Unanswered, reason: str = ""
) -> int:
    """Give every pending call of the turn without an outcome one (its words by the
    table in `core.results`), each with its TOOL_START if it never started; returns how
    many."""
    state = rt.store.load(run_id)
    if state is None or state.status != "running" or state.turn != turn:
        return 0
    stored = rt.store.outcomes(run_id, turn)
    missing = [call for call in state.awaiting if call.tool_use_id not in stored]
    if missing and not state.parallel_tools:
        # Every call is answered here: none of a sequential turn may be sent meanwhile.
        rt.store.close_sequence(run_id, turn)
    inputs = tool_inputs(state)
    for call in missing:
        started = rt.store.was_started(run_id, call.tool_use_id)
        outcome = unanswered_outcome(call, situation, started=started, reason=reason)
        record(rt, run_id, turn, outcome, tool_input=inputs.get(call.tool_use_id, {}))
    return len(missing)


def apply_cancel(rt: Runtime, run_id: str, cancel: CancelRequest | None) -> None:
    if cancel is None:
        return
    state = rt.store.load(run_id)
    if state is None or state.status != "running":
        return
    cancel_children(rt, run_id, cancel)
    close_parked(rt, run_id, cancel)  # before the fill: theirs is the truer word
    if must_stop_now(cancel, now_ms=now_ms(), deadline_ms=state.deadline_ms) and state.awaiting:
        fill_missing(rt, run_id, state.turn, "cancel", cancel.reason)


def handle_entry(rt: Runtime, member: str) -> bool:
    """Act on a due entry; True when it is done with (False: look again a lease later)."""
    kind, _, rest = member.partition(":")
    if kind == "turn":
        run_id, _, turn = rest.rpartition(":")
        if not _not_due_yet(rt, member, run_id, int(turn)):
            fill_missing(rt, run_id, int(turn), "deadline")
    elif kind == "approval":
        run_id, _, tool_use_id = rest.partition(":")
        parked_due(rt, run_id, tool_use_id)
    elif kind == "run":
        _run_deadline(rt, member, rest)
    elif kind == "cancel":
        apply_cancel(rt, rest, rt.store.cancel_request(rest))
    elif kind == "advance":
        run_id, _, turn = rest.rpartition(":")
        return resume_turn(rt, run_id, int(turn))
    elif kind == "probe":
        run_id, _, turn = rest.rpartition(":")
        probe_machines(rt, run_id, int(turn))
    elif kind == "start":
        return _start_due(rt, rest)
    else:
        log.error("dropping unknown watchdog entry %s", member)
    return True


def _not_due_yet(rt: Runtime, member: str, run_id: str, turn: int) -> bool:
    """Put the turn's deadline off while it is not due by what is stored: its calls'
    own deadlines (the latest, as at dispatch), and a parked call that still needs the
    time. True when it was (the entry is scheduled anew, so its claim's release keeps
    it). The entry's score alone is no proof: a machine may write the set."""
    state = rt.store.load(run_id)
    planned_ms = 0
    if state is not None and state.status == "running" and state.turn == turn and state.awaiting:
        planned_ms = max(call.deadline_ms for call in state.awaiting)
    due_ms = max(planned_ms, parked_hold_ms(rt, run_id, turn))
    if due_ms <= now_ms():
        return False
    rt.store.schedule(member, due_ms)
    return True


def _start_due(rt: Runtime, run_id: str) -> bool:
    """A client's start no coordinator has handled yet: it may have been lost on its
    way (`state.starts`), so it is sent again (its entry put off: the claim stays)."""
    unhandled = starts.due_again(rt.redis, rt.keys, run_id, now_ms=now_ms())
    if unhandled is None:
        return True
    log.warning("run %s: no coordinator has handled its start yet; sending it again", run_id)
    send_start(unhandled.request, sent_ms=unhandled.sent_ms)
    return False


def _run_deadline(rt: Runtime, member: str, run_id: str) -> None:
    state = rt.store.load(run_id)
    if state is None or state.status != "running":
        return
    if state.deadline_ms > now_ms():  # moved early by a writer of the set: put it back
        log.warning("run %s: its deadline entry came due early; put back", run_id)
        rt.store.schedule(member, state.deadline_ms)
        return
    # In one step with reading what is there: a request already made (a ui cancel
    # above all) is kept, never replaced by the deadline's.
    timeout = CancelRequest(channel="operation", reason="timeout")
    rt.store.request_cancel(run_id, timeout, now_ms=now_ms())
    apply_cancel(rt, run_id, rt.store.cancel_request(run_id))


class Watchdog:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmdop-watchdog", daemon=True)

    def start(self) -> None:
        self.rt.hub.add_listener(lambda run_id, cancel: apply_cancel(self.rt, run_id, cancel))
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)

    def sweep(self) -> int:
        now = now_ms()
        lease_ms = int(self.rt.settings.lease_s * 1000)
        members = self.rt.store.claim_due(now, lease_ms=lease_ms)
        for member in members:
            try:
                done = handle_entry(self.rt, member)
            except Exception:  # the claim lapses and the entry is tried again
                log.exception("watchdog entry %s failed", member)
                continue
            if done:
                self.rt.store.release_claim(member, now + lease_ms)
        return len(members)

    def _run(self) -> None:
        interval = self.rt.settings.watchdog_interval_s
        presence_key = self.rt.keys.coordinator(f"{socket.gethostname()}:{os.getpid()}")
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_beat:
                    self.rt.redis.set(
                        presence_key, "1", px=int(self.rt.settings.presence_ttl_s * 1000)
                    )
                    next_beat = time.monotonic() + self.rt.settings.presence_refresh_s
                self.sweep()
                OUTAGE.reached()
            except RedisError as exc:  # Redis restarting: keep trying, quietly
                OUTAGE.failed("watchdog", exc)
            except Exception:  # the thread must outlive any one bad sweep
                log.exception("watchdog sweep failed")
            self._stop.wait(interval)
        self._withdraw(presence_key)

    def _withdraw(self, presence_key: str) -> None:
        try:
            self.rt.redis.delete(presence_key)
        except RedisError as exc:  # Redis stopped first (honcho stops all at once)
            log.warning("could not remove %s (%s); its TTL ends it", presence_key, exc)
