"""Turn leases: who is executing a turn right now, for as long as they are alive.

Called by `turn.execute_turn` around the work of one turn (`with lease:`, which also
fences the run's state writes made in the block, and stops the turn's work, logged,
when one of them finds the lease lost: `LeaseLost`). The executor holds the turn lock
and its watchdog entry (`state.lease`, which owns the Redis side), both kept alive
every `lease_s / 3` by the process's one renewal thread:

- the turn lock: a second delivery of the turn (a redelivery, a watchdog re-enqueue)
  finds it and does nothing;
- the watchdog entry `advance:<id>:<n>` (due a lease from now): while it is renewed,
  it never comes due.

A turn that ends normally deletes both. A turn that raised deletes the lock but keeps
the entry, and an executor that died (SIGKILL, a lost host) renews neither: the lock
expires and the entry comes due, so the watchdog enqueues the turn again
(`recovery.resume_turn`) and the next executor can lock it. A dead holder's turn
therefore resumes within about one lease, whatever the broker does with its message.

An executor that stalls longer than a lease (and then wakes up) could overlap with
its successor; the lease is long (15 s by default) next to a renewal every 5 s. Its
writes cannot: the run's state is written under the lease's `fence` (`state.fence`),
whose Lua step checks that the turn is still the holder's before writing, so a holder
that lost the turn writes nothing, dispatches nothing and ends nothing. A renewal that
fails with a Redis error is retried at the next renewal; while it fails past the
lease's time, `held` is False and fenced writes are refused before Redis is asked.
When Redis answers again (it froze, or restarted, for longer than a lease) the holder
takes the lock back if nobody took the turn meanwhile (the lock is free and the
attempt count is still its own; `state.lease`), at the first of: its next renewal,
`held` past the lease's time (a renewal before the write), or a fenced write that
was already on its way (its script takes the lock back in the same step). The turn
goes on with what it has, and a model reply already received is not asked for
again. Only a successor's take (its token on the lock, or the count moved on) makes
the lease lost for good. A successor gives it the time to: a lock found free after
someone held it is taken only two renewals later (`acquire`), and a holder asks an
unreachable Redis again for a few leases before it gives the turn up (`held`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import AbstractContextManager
from types import TracebackType

from cmdop_worker.errors import LeaseLost
from cmdop_worker.runtime import Runtime
from cmdop_worker.state.connect import RedisError
from cmdop_worker.state.fence import Fence, fenced
from cmdop_worker.state.lease import TurnLock
from cmdop_worker.state.outage import OUTAGE

log = logging.getLogger(__name__)

# A turn that fails this many times in a row (an exception, or its executor dying each
# time) ends the run with an error instead of being retried forever.
MAX_TURN_ATTEMPTS = 4
# How long a holder past its lease's time keeps asking an unreachable Redis whether the
# turn is still its own, in leases, before it gives the turn up.
_PATIENCE_LEASES = 3
# How many of a holder's renewals a successor waits for it to take a lapsed lock back.
_TAKE_BACK_RENEWALS = 2


class TurnLease:
    def __init__(self, rt: Runtime, run_id: str, turn: int) -> None:
        lease_ms = max(int(rt.settings.lease_s * 1000), 300)
        self._lock = TurnLock(
            rt.redis, rt.keys, run_id, turn, token=uuid.uuid4().hex, lease_ms=lease_ms
        )
        self.state: str | bytes | None = None  # the run's state JSON when acquired
        self.attempt = 0
        self.member = self._lock.member
        self._lease_s = lease_ms / 1000
        self.renew_every_s = self._lease_s / 3
        self.renew_at = 0.0  # monotonic; set by the renewer
        self._keep = False
        self._run_id = run_id
        self._valid_until = 0.0  # monotonic: the lease's time as of its last renewal
        self._lost = False
        self._fenced: AbstractContextManager[Fence] | None = None

    def acquire(self) -> bool:
        """Take the turn (and read the run's state as of now); False when someone alive
        holds it."""
        asked = time.monotonic()
        taken = self._lock.acquire(patient=True)
        if taken.attempt < 0:
            # The lock lapsed after someone held it. Its holder may be alive (Redis froze
            # past the lease) with a model reply in hand: its next renewal takes the lock
            # back. Only a lock still free two renewals later is a dead holder's (one
            # would race the holder's own, due any moment within it).
            time.sleep(_TAKE_BACK_RENEWALS * self.renew_every_s)
            asked = time.monotonic()
            taken = self._lock.acquire()
        self.attempt, self.state = taken.attempt, taken.state
        if self.attempt <= 0:
            return False
        self._valid_until = asked + self._lease_s
        _renewer.add(self)
        return True

    def held(self) -> bool:
        """Whether the lease is still ours: within its time since the last renewal Redis
        confirmed, or, past it, taken back now (nobody else took the turn meanwhile)."""
        if self._lost:
            return False
        if time.monotonic() < self._valid_until:
            return True
        # Past its time: Redis was frozen or unreachable. Ask it before writing, again
        # while it cannot answer (for a few leases: a successor needs Redis too). Its yes
        # stands even when the answer took longer than a lease (a freeze with the ask
        # pending): the fenced write checks again, in its own script, that the turn is ours.
        give_up = time.monotonic() + _PATIENCE_LEASES * self._lease_s
        while not self.renew():
            if self._lost or time.monotonic() >= give_up:
                return False
            time.sleep(self.renew_every_s)
        return not self._lost

    @property
    def fence(self) -> Fence:
        """What this executor's writes of the run's state go under (`state.fence`)."""
        return Fence(
            run_id=self._run_id,
            lock_key=self._lock.lock_key,
            attempts_key=self._lock.attempts_key,
            token=self._lock.token,
            attempt=self._lock.attempt,
            lease_ms=self._lock.lease_ms,
            held=self.held,
        )

    @property
    def exhausted(self) -> bool:
        return self.attempt > MAX_TURN_ATTEMPTS

    def last_error(self) -> str:
        return self._lock.last_error()

    def keep_entry(self) -> None:
        """Leave the watchdog entry in place on exit: the turn was not carried out here."""
        self._keep = True

    def __enter__(self) -> TurnLease:
        # The run's state is written under this lease for as long as the block runs.
        self._fenced = fenced(self.fence)
        self._fenced.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._fenced is not None:
            self._fenced.__exit__(None, None, None)
        _renewer.remove(self)
        if isinstance(exc, LeaseLost):
            # Not a failure of the turn: its successor carries it on. Stop here.
            log.warning("run %s: %s; this executor stops", self._run_id, exc)
            return True
        try:
            if exc is not None:
                self._lock.record_error(f"{type(exc).__name__}: {exc}")
            # After an error the entry stays: the watchdog retries the turn a lease later.
            self._lock.release(done=exc_type is None and not self._keep)
        except RedisError as err:
            log.warning("could not release turn lease %s: %s", self.member, err)
        return False

    def renew(self) -> bool:
        """Extend the lease and its watchdog entry (taking the lease back if it lapsed
        and nobody took the turn); whether it is ours as of now. A Redis error counts
        as ours while the lease's time lasts, and is tried again at the next renewal
        even after: only someone else having the turn makes the lease `lost`."""
        asked = time.monotonic()
        try:
            renewed = self._lock.renew()
        except RedisError as err:
            OUTAGE.failed(f"renewing turn lease {self.member}", err)
            return asked < self._valid_until
        OUTAGE.reached()
        if renewed:
            self._valid_until = asked + self._lease_s
        else:
            self._lost = True
        return renewed

    @property
    def lost(self) -> bool:
        """Someone else has the turn: this lease never comes back."""
        return self._lost


class _Renewer:
    """One thread per process renews every turn lease held in it, each every third of
    its lease — not a thread per turn, whose start and join each turn would pay."""

    def __init__(self) -> None:
        self._leases: set[TurnLease] = set()
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, lease: TurnLease) -> None:
        lease.renew_at = time.monotonic() + lease.renew_every_s
        with self._lock:
            self._leases.add(lease)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="cmdop-lease-renewer", daemon=True
                )
                self._thread.start()
        self._changed.set()

    def remove(self, lease: TurnLease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def _run(self) -> None:
        while True:
            with self._lock:
                held = list(self._leases)
            now = time.monotonic()
            for lease in held:
                if lease.renew_at <= now:
                    lease.renew_at = now + lease.renew_every_s
                    self._renew(lease)
            next_at = min((lease.renew_at for lease in held), default=now + 60.0)
            self._changed.wait(max(next_at - time.monotonic(), 0.0))
            self._changed.clear()

    def _renew(self, lease: TurnLease) -> None:
        try:
            if lease in self._leases and not lease.renew() and lease.lost:
                log.warning("lost the turn lease %s", lease.member)
                self.remove(lease)
        except Exception:  # this thread keeps every lease of the process alive
            log.exception("renewing the turn lease %s failed", lease.member)


_renewer = _Renewer()
