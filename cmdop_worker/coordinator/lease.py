"""Turn leases: who is executing a turn right now, for as long as they are alive.

Called by `turn.execute_turn` around the work of one turn (`with lease:`, which also
fences the run's state writes made in the block, and stops the turn's work, logged,
when one of them finds the lease lost: `LeaseLost`). The executor holds two things,
both kept alive every `lease_s / 3` by the process's one renewal thread:

- the turn lock `<p>run:<id>:turn:<n>:lock` (PX lease): a second delivery of the turn
  (a redelivery, a watchdog re-enqueue) finds it and does nothing;
- the watchdog entry `advance:<id>:<n>` (due a lease from now): while it is renewed,
  it never comes due.

A turn that ends normally deletes both. A turn that raised deletes the lock but keeps
the entry, and an executor that died (SIGKILL, a lost host) renews neither: the lock
expires and the entry comes due, so the watchdog enqueues the turn again
(`recovery.resume_turn`) and the next executor can lock it. A dead holder's turn
therefore resumes within about one lease, whatever the broker does with its message.

An executor that stalls longer than a lease (and then wakes up) could overlap with
its successor; the lease is long (15 s by default) next to a renewal every 5 s. Its
writes cannot: the run's state is written under the lease's `fence`
(`state.fence`), checked against the lock's token in the same Lua step, so a holder
that lost the turn writes nothing, dispatches nothing and ends nothing. A renewal that
fails with a Redis error is retried at the next renewal while the lease's time lasts;
once it is up the lease counts as lost (`held` is False), as if a successor had it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import AbstractContextManager
from types import TracebackType

import redis

from cmdop_worker.errors import LeaseLost
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.fence import Fence, fenced
from cmdop_worker.state.keys import advance_member

log = logging.getLogger(__name__)

# KEYS: lock, deadlines, attempts, the run's state. ARGV: token, lease_ms, member, due.
# Returns the attempt number of this execution of the turn (0 when someone else holds
# it) and the run's state as of taking the lease.
_ACQUIRE_LUA = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {0, false} end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
local n = redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], 86400)
return {n, redis.call('GET', KEYS[4])}
"""
# A turn that fails this many times in a row (an exception, or its executor dying each
# time) ends the run with an error instead of being retried forever.
MAX_TURN_ATTEMPTS = 4

_RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
return 1
"""

# ARGV[3]: the entry to remove when the turn was carried out, '' to keep it.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], ARGV[3]) end
return 1
"""

# The entry comes due a little after the lock expires, so the turn it re-enqueues
# finds the lock free.
_ENTRY_MARGIN_MS = 500


class TurnLease:
    def __init__(self, rt: Runtime, run_id: str, turn: int) -> None:
        self._redis = rt.redis
        self._keys = [rt.keys.turn(run_id, turn, "lock"), rt.keys.deadlines]
        self._attempts_key = rt.keys.turn(run_id, turn, "attempts")
        self._state_key = rt.keys.state(run_id)
        self.state: str | bytes | None = None  # the run's state JSON when acquired
        self._error_key = rt.keys.turn(run_id, turn, "error")
        self.attempt = 0
        self.member = advance_member(run_id, turn)
        self._token = uuid.uuid4().hex
        self._lease_ms = max(int(rt.settings.lease_s * 1000), 300)
        self.renew_every_s = self._lease_ms / 3000
        self.renew_at = 0.0  # monotonic; set by the renewer
        self._keep = False
        self._run_id = run_id
        self._valid_until = 0.0  # monotonic: the lease's time as of its last renewal
        self._lost = False
        self._fenced: AbstractContextManager[Fence] | None = None

    def _args(self, member: str | None = None) -> list[str | int]:
        due = now_ms() + self._lease_ms + _ENTRY_MARGIN_MS
        return [self._token, self._lease_ms, self.member if member is None else member, due]

    def acquire(self) -> bool:
        """Take the turn (and read the run's state as of now); False when someone alive
        holds it."""
        script = self._redis.register_script(_ACQUIRE_LUA)
        keys = [*self._keys, self._attempts_key, self._state_key]
        asked = time.monotonic()
        attempt, self.state = script(keys=keys, args=self._args())
        self.attempt = int(attempt)
        if not self.attempt:
            return False
        self._valid_until = asked + self._lease_ms / 1000
        _renewer.add(self)
        return True

    def held(self) -> bool:
        """Whether the lease is still ours as far as this process knows: not found lost
        and within its time since the last renewal Redis confirmed."""
        return not self._lost and time.monotonic() < self._valid_until

    @property
    def fence(self) -> Fence:
        """What this executor's writes of the run's state go under (`state.fence`)."""
        return Fence(run_id=self._run_id, lock_key=self._keys[0], token=self._token, held=self.held)

    @property
    def exhausted(self) -> bool:
        return self.attempt > MAX_TURN_ATTEMPTS

    def last_error(self) -> str:
        return str(self._redis.get(self._error_key) or "its executor stopped each time")

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
        # After an error the entry stays: the watchdog retries the turn a lease later.
        done = "" if exc_type is not None or self._keep else self.member
        try:
            if exc is not None:
                self._redis.set(self._error_key, f"{type(exc).__name__}: {exc}"[:500], ex=86400)
            self._redis.register_script(_RELEASE_LUA)(keys=self._keys, args=self._args(done))
        except redis.RedisError as err:
            log.warning("could not release turn lease %s: %s", self.member, err)
        return False

    def renew(self) -> bool:
        """Extend the lease and its watchdog entry; False once it is lost (or released):
        someone else holds the lock, or Redis could not be reached until its time ran out."""
        asked = time.monotonic()
        try:
            script = self._redis.register_script(_RENEW_LUA)
            renewed = bool(script(keys=self._keys, args=self._args()))
        except redis.RedisError as err:
            if asked < self._valid_until:
                log.warning("could not renew turn lease %s: %s; retrying", self.member, err)
                return True  # try again at the next renewal, while the lease lasts
            log.warning("could not renew turn lease %s before it ran out: %s", self.member, err)
            renewed = False
        if renewed:
            self._valid_until = asked + self._lease_ms / 1000
        else:
            self._lost = True
        return renewed


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
            if lease in self._leases and not lease.renew() and lease in self._leases:
                log.warning("lost the turn lease %s", lease.member)
                self.remove(lease)
        except Exception:  # this thread keeps every lease of the process alive
            log.exception("renewing the turn lease %s failed", lease.member)


_renewer = _Renewer()
