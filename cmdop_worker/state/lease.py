"""A turn's lock in Redis: taken, kept alive, taken back and given back in one step each.

Called by `coordinator.lease.TurnLease` (the executor's side: the `with` block, the
fence and the renewal thread). A turn's executor holds:

- the turn lock `<p>run:<id>:turn:<n>:lock` (PX `lease_ms`) under a token of its own;
- the watchdog entry `advance:<id>:<n>`, due a lease (and a margin) from each renewal;
- the attempt count `<p>run:<id>:turn:<n>:attempts`, one more at each take.

A lock can lapse while its holder is alive: Redis froze, or was unreachable, for longer
than the lease. If nobody took the turn meanwhile (the lock is free and the attempt
count is still the holder's), the holder takes it back at the first of its next
renewal, its release, or its next fenced write (`state.fence`, whose script checks
the same `HOLDS_FUNCTION` and takes the lock back in the step that writes), and
carries the turn on with what it has, such as a model reply already received.
Asking the model again for it would cost a second reply, and a second, different one.
Once someone else took the turn (the lock holds their token, or the count moved on),
the old holder never gets it back: every one of those steps refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from cmdop_worker.state.connect import now_ms
from cmdop_worker.state.fence import HOLDS_FUNCTION
from cmdop_worker.state.keys import Keys, advance_member
from cmdop_worker.state.scripts import script

# Takes the turn, unless someone alive holds it, and reads the run's state as of now.
# Returns this execution's attempt number (0: held elsewhere) and that state. Asked
# `patient`ly, a lock free after someone held it (the count is past 0) answers -1 and
# takes nothing: its holder may be alive and about to take it back (`HOLDS_FUNCTION`:
# Redis froze past the lease), so the asker waits two renewals and asks again, impatient.
_ACQUIRE_LUA = """
local lock_key, deadlines_key, attempts_key, state_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local token, lease_ms, member, due_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local patient = ARGV[5] == '1'
if redis.call('EXISTS', lock_key) == 1 then return {0, false} end
if patient and tonumber(redis.call('GET', attempts_key) or '0') > 0 then return {-1, false} end
redis.call('SET', lock_key, token, 'PX', lease_ms)
redis.call('ZADD', deadlines_key, due_ms, member)
local attempt = redis.call('INCR', attempts_key)
redis.call('EXPIRE', attempts_key, 86400)
return {attempt, redis.call('GET', state_key)}
"""

# Extends the lease (taking it back if it lapsed untaken) and pushes its watchdog entry
# a lease ahead. Returns 1, or 0 when someone else has the turn.
_RENEW_LUA = (
    HOLDS_FUNCTION
    + """
local lock_key, deadlines_key, attempts_key = KEYS[1], KEYS[2], KEYS[3]
local token, lease_ms, member, due_ms, attempt = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if not holds(lock_key, attempts_key, token, attempt, lease_ms) then return 0 end
redis.call('PEXPIRE', lock_key, lease_ms)
redis.call('ZADD', deadlines_key, due_ms, member)
return 1
"""
)

# Gives the turn back; removes the watchdog entry when the turn was carried out
# (`done_member`; '' keeps it, for the watchdog to retry the turn). 0: not ours.
_RELEASE_LUA = (
    HOLDS_FUNCTION
    + """
local lock_key, deadlines_key, attempts_key = KEYS[1], KEYS[2], KEYS[3]
local token, lease_ms, done_member, attempt = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if not holds(lock_key, attempts_key, token, attempt, lease_ms) then return 0 end
redis.call('DEL', lock_key)
if done_member ~= '' then redis.call('ZREM', deadlines_key, done_member) end
return 1
"""
)

# The entry comes due a little after the lock expires, so the turn it re-enqueues
# finds the lock free.
_ENTRY_MARGIN_MS = 500
_ERROR_TTL_S = 86400


@dataclass(frozen=True)
class Taken:
    """The outcome of `TurnLock.acquire`: the attempt number (0: held elsewhere; -1:
    lapsed after a holder, asked patiently) and the run's state JSON as of the take."""

    attempt: int
    state: str | bytes | None


class TurnLock:
    """One turn's lock, held under `token` for `lease_ms` at a time."""

    def __init__(
        self, client: redis.Redis, keys: Keys, run_id: str, turn: int, *, token: str, lease_ms: int
    ) -> None:
        self._redis = client
        self.lock_key = keys.turn(run_id, turn, "lock")
        self._deadlines_key = keys.deadlines
        self.attempts_key = keys.turn(run_id, turn, "attempts")
        self._state_key = keys.state(run_id)
        self._error_key = keys.turn(run_id, turn, "error")
        self.member = advance_member(run_id, turn)
        self.token = token
        self.lease_ms = lease_ms
        self.attempt = 0

    def acquire(self, *, patient: bool = False) -> Taken:
        """Take the turn; `patient`: not a lock that lapsed after someone held it
        (attempt -1: ask again, impatient, once its holder had two renewals' time)."""
        taken = script(self._redis, _ACQUIRE_LUA)(
            keys=[self.lock_key, self._deadlines_key, self.attempts_key, self._state_key],
            args=[self.token, self.lease_ms, self.member, self._entry_due_ms(), int(patient)],
        )
        attempt, state = taken
        self.attempt = int(attempt)
        return Taken(self.attempt, state)

    def renew(self) -> bool:
        """Keep (or take back) the lock; False when someone else has the turn. Raises
        `redis.RedisError` when Redis could not be asked."""
        renewed = script(self._redis, _RENEW_LUA)(
            keys=[self.lock_key, self._deadlines_key, self.attempts_key],
            args=[self.token, self.lease_ms, self.member, self._entry_due_ms(), self.attempt],
        )
        return bool(renewed)

    def release(self, *, done: bool) -> bool:
        """Give the lock back, removing the watchdog entry when `done`."""
        released = script(self._redis, _RELEASE_LUA)(
            keys=[self.lock_key, self._deadlines_key, self.attempts_key],
            args=[self.token, self.lease_ms, self.member if done else "", self.attempt],
        )
        return bool(released)

    def record_error(self, error: str) -> None:
        self._redis.set(self._error_key, error[:500], ex=_ERROR_TTL_S)

    def last_error(self) -> str:
        return str(self._redis.get(self._error_key) or "its executor stopped each time")

    def _entry_due_ms(self) -> int:
        return now_ms() + self.lease_ms + _ENTRY_MARGIN_MS
