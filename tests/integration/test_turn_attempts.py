"""A turn that fails every time ends its run with an error instead of looping."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.coordinator import lease as lease_module
from cmdop_worker.coordinator import turn as turn_module
from cmdop_worker.coordinator.lease import MAX_TURN_ATTEMPTS, TurnLease
from cmdop_worker.coordinator.runs import initial_state
from cmdop_worker.errors import LeaseLost
from cmdop_worker.models import RunRequest
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.connect import RedisConnectionError

pytestmark = pytest.mark.integration


def test_a_turn_that_always_raises_ends_the_run_with_its_cause(redis_server, monkeypatch) -> None:
    rt = Runtime(Settings(redis_url=redis_server.url, key_prefix=f"t{uuid.uuid4().hex[:8]}:"))
    try:
        run_id = "always-fails"
        rt.store.create(initial_state(rt, RunRequest(prompt="hi"), run_id))

        def boom(*args: object, **kwargs: object) -> None:
            raise RuntimeError("the model client exploded")

        monkeypatch.setattr(turn_module, "decide_before_model", boom)
        for _ in range(MAX_TURN_ATTEMPTS):
            with pytest.raises(RuntimeError):
                turn_module.execute_turn(rt, run_id, 1)
        turn_module.execute_turn(rt, run_id, 1)  # one more delivery: it gives up

        result = rt.store.load_result(run_id)
        assert result is not None and result.status == "error"
        assert result.error is not None and result.error.kind == "turn_failed"
        assert "the model client exploded" in result.error.message
        events = rt.redis.xrange(rt.keys.events(run_id))
        assert len(events) == 1 and '"type":"ERROR"' in events[0][1]["event"]
    finally:
        rt.close()


def test_leases_held_longer_than_their_term_are_renewed_until_released(redis_server) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    rt = Runtime(Settings(redis_url=redis_server.url, key_prefix=prefix, lease_s=1.0))
    try:
        leases = [TurnLease(rt, f"renewed-{i}", 1) for i in range(3)]
        assert all(lease.acquire() for lease in leases)
        time.sleep(3.5)  # three and a half lease terms: only renewals keep them
        for lease in leases:
            lock = rt.keys.turn(lease.member.split(":")[1], 1, "lock")
            assert rt.redis.pttl(lock) > 0
            due = rt.redis.zscore(rt.keys.deadlines, lease.member)
            assert due is not None and due > now_ms()
            assert not TurnLease(rt, lease.member.split(":")[1], 1).acquire()
        with leases[0]:
            pass
        again = TurnLease(rt, "renewed-0", 1)
        assert again.acquire()  # released: free again at once
        time.sleep(0.5)
        assert rt.redis.pttl(rt.keys.turn("renewed-1", 1, "lock")) > 0
        for lease in (again, *leases[1:]):
            with lease:
                pass
    finally:
        rt.close()


def test_a_lease_taken_back_by_a_renewal_slower_than_the_lease_is_held(redis_server) -> None:
    """Redis froze with the holder's renewal pending, for longer than the lease: the
    renewal took the lapsed lease back (nobody took the turn), so the holder writes on
    with the reply it has; the write's own script checks again that the turn is its own."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    rt = Runtime(Settings(redis_url=redis_server.url, key_prefix=prefix, lease_s=0.3))
    try:
        lease = TurnLease(rt, "slow-renewal", 1)
        assert lease.acquire()
        lock, real_renew = lease._lock, lease._lock.renew

        def frozen_then_answered() -> bool:
            time.sleep(2 * lock.lease_ms / 1000)  # Redis frozen for two leases
            return real_renew()

        lock.renew = frozen_then_answered  # type: ignore[method-assign]
        time.sleep(lock.lease_ms / 1000 + 0.05)  # the lease's time is up
        assert lease.held()
        assert not lease.lost
        assert rt.redis.get(lock.lock_key) == lock.token
        with lease:
            pass
    finally:
        rt.close()


def _held_lease_over_a_lapsed_lock(rt: Runtime, run_id: str) -> TurnLease:
    """A lease whose holder still counts it held (within its time) while its lock is
    gone, as after a Redis freeze longer than the lease with a write pending."""
    rt.store.create(initial_state(rt, RunRequest(prompt="hi"), run_id))
    lease = TurnLease(rt, run_id, 1)
    assert lease.acquire()
    rt.redis.delete(rt.keys.turn(run_id, 1, "lock"))
    return lease


def test_a_fenced_write_after_its_lock_lapsed_untaken_takes_the_lock_back(redis_server) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    rt = Runtime(Settings(redis_url=redis_server.url, key_prefix=prefix, lease_s=30.0))
    try:
        lease = _held_lease_over_a_lapsed_lock(rt, "lapsed-untaken")
        state = rt.store.load("lapsed-untaken")
        assert state is not None
        with lease:
            rt.store.save(state.model_copy(update={"turn": 7}))
            lock_key = rt.keys.turn("lapsed-untaken", 1, "lock")
            assert rt.redis.get(lock_key) == lease._lock.token
            assert 0 < rt.redis.pttl(lock_key) <= 30_000
        saved = rt.store.load("lapsed-untaken")
        assert saved is not None and saved.turn == 7
    finally:
        rt.close()


@pytest.mark.parametrize("successor", ["holds the lock", "took the turn and let it go"])
def test_a_fenced_write_after_a_successor_took_the_turn_is_refused(
    redis_server, successor: str
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    rt = Runtime(Settings(redis_url=redis_server.url, key_prefix=prefix, lease_s=30.0))
    try:
        run_id = "lapsed-taken"
        lease = _held_lease_over_a_lapsed_lock(rt, run_id)
        lock_key = rt.keys.turn(run_id, 1, "lock")
        rt.redis.incr(rt.keys.turn(run_id, 1, "attempts"))  # a successor's take
        if successor == "holds the lock":
            rt.redis.set(lock_key, "successor", px=30_000)
        state = rt.store.load(run_id)
        assert state is not None
        with lease, pytest.raises(LeaseLost):
            rt.store.save(state.model_copy(update={"turn": 7}))
        assert rt.redis.get(lock_key) == ("successor" if successor == "holds the lock" else None)
        kept = rt.store.load(run_id)
        assert kept is not None and kept.turn == state.turn
    finally:
        rt.close()


def test_a_successor_leaves_a_lapsed_lock_to_a_holder_that_takes_it_back(redis_server) -> None:
    """A redelivered turn finding the lock lapsed after a holder waits two renewals: the
    holder, alive (Redis froze past the lease), takes it back in that time and keeps
    the turn, so the reply it already has is not asked for again."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    rt = Runtime(Settings(redis_url=redis_server.url, key_prefix=prefix, lease_s=0.9))
    try:
        holder = TurnLease(rt, "lapsed-alive", 1)
        assert holder.acquire()  # its renewal thread runs every 0.3 s
        rt.redis.delete(holder._lock.lock_key)  # lapsed, nobody took it
        successor = TurnLease(rt, "lapsed-alive", 1)
        assert not successor.acquire()
        assert rt.redis.get(holder._lock.lock_key) == holder._lock.token
        assert holder.held() and not holder.lost
        with holder:
            pass
    finally:
        rt.close()


def test_a_lapsed_lock_whose_holder_is_gone_is_taken_a_renewal_later(redis_server) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    rt = Runtime(Settings(redis_url=redis_server.url, key_prefix=prefix, lease_s=0.9))
    try:
        lock_key = rt.keys.turn("lapsed-dead", 1, "lock")
        rt.redis.set(rt.keys.turn("lapsed-dead", 1, "attempts"), 1)  # a holder was here
        successor = TurnLease(rt, "lapsed-dead", 1)
        assert successor.acquire()
        assert successor.attempt == 2
        assert rt.redis.get(lock_key) == successor._lock.token
        with successor:
            pass
    finally:
        rt.close()


def test_a_holder_past_its_time_asks_again_while_redis_cannot_answer(redis_server) -> None:
    """A renewal that fails (Redis unreachable) past the lease's time is asked again,
    not taken for a lost lease: the turn is still the holder's when Redis answers."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    rt = Runtime(Settings(redis_url=redis_server.url, key_prefix=prefix, lease_s=0.3))
    try:
        lease = TurnLease(rt, "unreachable", 1)
        assert lease.acquire()
        lease_module._renewer.remove(lease)  # only `held` asks Redis here
        lock, real_renew = lease._lock, lease._lock.renew
        failures, asker = [], threading.current_thread()

        def unreachable_twice() -> bool:
            if threading.current_thread() is asker and len(failures) < 2:
                failures.append(1)
                raise RedisConnectionError("Redis is unreachable")
            return real_renew()

        lock.renew = unreachable_twice  # type: ignore[method-assign]
        # The lease's time is up, even counted from a renewal the thread made as it left.
        time.sleep(lock.lease_ms / 1000 + 0.2)
        assert lease.held()
        assert len(failures) == 2 and not lease.lost
        with lease:
            pass
    finally:
        rt.close()
