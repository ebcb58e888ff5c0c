"""Fenced writes: a turn's executor writes its run's state only while it holds the turn.

A turn executor holds the turn lock `<p>run:<id>:turn:<n>:lock` under a token of its
own (`coordinator.lease.TurnLease`). Inside `fenced(fence)` every write of that run's
state by `RunStore` (`save`, the save of `open_turn`, `end_run`) checks, in the same
Lua step as the write, that the turn is still the holder's (`HOLDS_FUNCTION`, shared
with `state.lease`'s renewal): the lock holds its token, or the lock is free and the
turn's attempt count is still the holder's, in which case the write takes the lock
back (PX a lease) before writing. A lock lapses that way while its holder is alive
when Redis froze for longer than a lease with the write pending; nobody took the
turn, so the write goes on and a model reply already received is not asked for again.
Once someone else took the turn (the lock holds another token, or the count moved on),
nothing is written and `LeaseLost` is raised, so the old holder dispatches nothing and
emits no terminal event. The holder's own view counts too: once its lease's time is
up without a renewal (Redis unreachable), `Fence.held` asks Redis (a renewal, which
takes the lock back under the same condition) and the write is refused before the
script runs when that says the turn is someone else's, or Redis cannot be reached.

Writes outside a fence (the watchdog, recovery, clients) and writes of another run's
state are not fenced. Every fenced write asks `write_fence` for the keys and arguments
to pass its script (`store`, `barrier`, `eager`, `threads`); the coordinator sets the scope.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cmdop_worker.errors import LeaseLost

# `holds(...)`: whether the turn is still the holder's: the lock holds its token, or
# the lock is free and nobody took the turn since (the attempt count unchanged), in
# which case it takes the lock back (PX `lease_ms`). The renewal, the release
# (`state.lease`) and every fenced write share this one condition.
HOLDS_FUNCTION = """
local function holds(lock_key, attempts_key, token, attempt, lease_ms)
  local holder = redis.call('GET', lock_key)
  if holder == token then return true end
  if holder or redis.call('GET', attempts_key) ~= attempt then return false end
  redis.call('SET', lock_key, token, 'PX', lease_ms)
  return true
end
"""

# `fenced(...)`: true when the write may go on (an empty token: not fenced). A script
# passes the `WriteFence` of `write_fence`: `keys` (lock, attempts) and `args` (token,
# attempt, lease_ms), named in its header in that order.
FENCE_FUNCTION = (
    HOLDS_FUNCTION
    + """
local function fenced(lock_key, attempts_key, token, attempt, lease_ms)
  return token == '' or holds(lock_key, attempts_key, token, attempt, lease_ms)
end
"""
)


@dataclass(frozen=True)
class Fence:
    """The claim a turn's executor writes under: its run, the turn lock, its token and
    its take of the turn (attempt count and key), and the lease a take-back sets."""

    run_id: str
    lock_key: str
    attempts_key: str
    token: str
    attempt: int  # the holder's take of the turn (the attempt count it set)
    lease_ms: int
    held: Callable[[], bool] = lambda: True  # False once the holder knows it lost it


_active: contextvars.ContextVar[Fence | None] = contextvars.ContextVar("cmdop_fence", default=None)


@contextmanager
def fenced(fence: Fence) -> Iterator[Fence]:
    """Fence this thread's writes of `fence.run_id`'s state for the `with` block."""
    reset = _active.set(fence)
    try:
        yield fence
    finally:
        _active.reset(reset)


def active_fence(run_id: str) -> Fence | None:
    """The fence that writes of `run_id`'s state go under here, if any."""
    fence = _active.get()
    return fence if fence is not None and fence.run_id == run_id else None


@dataclass(frozen=True)
class WriteFence:
    """What a fenced script is given: the lock and attempt count to check, the token
    the lock must hold, the attempt number the count must still be and the lease a
    take-back sets (an empty token: the write is not fenced, and the keys are only
    placeholders)."""

    lock_key: str
    attempts_key: str = ""
    token: str = ""
    attempt: int = 0
    lease_ms: int = 0

    @property
    def keys(self) -> dict[str, str]:
        """The script's fence keys, in its header's order: lock, attempts."""
        return {"lock": self.lock_key, "attempts": self.attempts_key or self.lock_key}

    @property
    def args(self) -> dict[str, str | int]:
        """The script's fence arguments, in its header's order: token, attempt, lease_ms."""
        return {"token": self.token, "attempt": self.attempt, "lease_ms": self.lease_ms}


def write_fence(run_id: str, *, unfenced_lock: str, refused: str) -> WriteFence:
    """The fence a write of `run_id`'s state goes under here: the active one, once its
    holder still holds it (else `LeaseLost`, saying `refused`, before Redis is asked),
    or none (`unfenced_lock`, which no token is checked against)."""
    fence = active_fence(run_id)
    if fence is None:
        return WriteFence(unfenced_lock)
    if not fence.held():
        raise LeaseLost(f"run {run_id}: the turn's lease ran out; {refused}")
    return WriteFence(
        fence.lock_key, fence.attempts_key, fence.token, fence.attempt, fence.lease_ms
    )
