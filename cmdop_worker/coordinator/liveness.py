"""Calls whose machine has gone: answered within seconds, not at their deadline.

A tool may be given up to ten minutes; when its machine worker dies, waiting for the
call's deadline would stall the run that long. While a turn has calls on machines, the
watchdog probes it every `presence_ttl_s` (entry `probe:<run>:<n>`). A call whose
machine has no presence key at two probes in a row, a presence TTL apart by the stored
time of the first miss however soon a probe comes — one missed heartbeat is not a
death — is answered: "started; outcome unknown; machine lost" if the machine had begun
it, "went offline" if not (`core.results.unanswered_outcome`), with its TOOL_START when it
never started. The outcome is stored once, like any other, so a worker that comes back
and finds it answered does not run the call. A call parked for a person's answer holds
nothing on its machine and is left alone until it is answered. In a sequential turn
only the call out now is probed: the others have not been sent, and answering one of
those would break the model's order (a probe keeps coming while the turn has calls in
line).

Called by `calls` (the first probe's entry, as a turn opens) and the watchdog (each
due probe).
"""

from __future__ import annotations

import logging

from cmdop_worker.coordinator.approvals import approvals_of
from cmdop_worker.core.results import unanswered_outcome
from cmdop_worker.outcomes import record
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.keys import probe_member
from cmdop_worker.state.presence import online_machines
from cmdop_worker.state.store import PendingCall, tool_inputs

log = logging.getLogger(__name__)


def probe_entry(rt: Runtime, run_id: str, turn: int) -> tuple[str, int]:
    """The watchdog entry of the turn's next probe, and when it is due."""
    return probe_member(run_id, turn), now_ms() + int(rt.settings.presence_ttl_s * 1000)


def schedule_probe(rt: Runtime, run_id: str, turn: int) -> None:
    rt.store.schedule(*probe_entry(rt, run_id, turn))


def probe_machines(rt: Runtime, run_id: str, turn: int) -> None:
    state = rt.store.load(run_id)
    if state is None or state.status != "running" or state.turn != turn:
        return
    stored = rt.store.outcomes(run_id, turn)
    waiting = [c for c in state.awaiting if c.tool_use_id not in stored and c.machine]
    if not state.parallel_tools:  # only the call out now was sent: the rest wait in line
        out = rt.store.current_call(run_id, turn)
        waiting = [c for c in waiting if c.tool_use_id == out]
    if not waiting and state.parallel_tools:
        return
    online = {p.machine for p in online_machines(rt.redis, rt.keys)}
    gone = [c for c in waiting if c.machine not in online]
    if gone:  # a call parked for a person holds nothing on its machine: not lost with it
        parked = {p.call.tool_use_id for p in approvals_of(rt).of_run(run_id)}
        gone = [c for c in gone if c.tool_use_id not in parked or _approved(rt, run_id, c)]
    inputs = tool_inputs(state)
    for call in gone:
        if _missing_before(rt, run_id, str(call.machine)):
            log.warning(
                "run %s: machine %s is gone; answering %s", run_id, call.machine, call.tool_use_id
            )
            started = rt.store.was_started(run_id, call.tool_use_id)
            outcome = unanswered_outcome(call, "machine_gone", started=started)
            record(rt, run_id, turn, outcome, tool_input=inputs.get(call.tool_use_id, {}))
    schedule_probe(rt, run_id, turn)


def _approved(rt: Runtime, run_id: str, call: PendingCall) -> bool:
    """Whether a parked call has been answered (so a machine was asked to act on it)."""
    record = approvals_of(rt).load(run_id, call.tool_use_id)
    return record is not None and record.state != "waiting"


def _missing_before(rt: Runtime, run_id: str, machine: str) -> bool:
    """True when the machine was already missing at an earlier probe of this run, a
    presence TTL or more ago. The time is the stored first miss, not how soon the probe
    came: machines may write the watchdog's set, so probes may come back to back."""
    ttl_ms = int(rt.settings.presence_ttl_s * 1000)
    key, now = rt.keys.run(run_id, f"missing:{machine}"), now_ms()
    if rt.redis.set(key, str(now), nx=True, px=3 * ttl_ms):
        return False
    first = rt.redis.get(key)
    try:
        first_ms = int(first) if first is not None else now
    except ValueError:
        first_ms = now
    return now - first_ms >= ttl_ms
