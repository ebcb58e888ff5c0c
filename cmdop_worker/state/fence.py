"""Fenced writes: a turn's executor writes its run's state only while it holds the turn.

A turn executor holds the turn lock `<p>run:<id>:turn:<n>:lock` under a token of its
own (`coordinator.lease.TurnLease`). Inside `fenced(fence)` every write of that run's
state by `RunStore` (`save`, the save of `open_turn`, `end_run`) checks, in the same
Lua step as the write, that the lock still holds the token; if it does not — the lease
lapsed and a successor may have taken the turn — nothing is written and `LeaseLost`
is raised, so the old holder dispatches nothing and emits no terminal event. The
holder's own view counts too: once its lease's time is up without a renewal (Redis
unreachable), `Fence.held` is False and the write is refused before Redis is asked.

Writes outside a fence (the watchdog, recovery, clients) and writes of another run's
state are not fenced. Every fenced write asks `write_fence` for the lock and token to
pass its script (`store`, `barrier`, `eager`, `threads`); the coordinator sets the scope.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cmdop_worker.errors import LeaseLost

# `fenced(lock, token)`: true when the write may go on. An empty token: not fenced.
# A script passes the `WriteFence` of `write_fence` as its lock key and token.
FENCE_FUNCTION = """
local function fenced(lock, token)
  return token == '' or redis.call('GET', lock) == token
end
"""


@dataclass(frozen=True)
class Fence:
    """The claim a turn's executor writes under: its run, the turn lock and its token."""

    run_id: str
    lock_key: str
    token: str
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
    """What a fenced script is given: the lock to check and the token it must hold
    (an empty token: the write is not fenced, and `lock_key` is only a placeholder)."""

    lock_key: str
    token: str


def write_fence(run_id: str, *, unfenced_lock: str, refused: str) -> WriteFence:
    """The fence a write of `run_id`'s state goes under here: the active one, once its
    holder still holds it (else `LeaseLost`, saying `refused`, before Redis is asked),
    or none (`unfenced_lock`, which no token is checked against)."""
    fence = active_fence(run_id)
    if fence is None:
        return WriteFence(unfenced_lock, "")
    if not fence.held():
        raise LeaseLost(f"run {run_id}: the turn's lease ran out; {refused}")
    return WriteFence(fence.lock_key, fence.token)
