"""The thread claim script against a real Redis: who owns a thread, in what order
waiting requests get it, and how a claim whose starter died stops holding it."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from cmdop_worker.errors import ThreadBusy
from cmdop_worker.models import Message
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.threads import STARTING_GRACE_MS, Claim, ThreadStore

pytestmark = pytest.mark.integration

NOW = 1_000_000


@pytest.fixture
def store(redis_server) -> Iterator[ThreadStore]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys(f"tt{uuid.uuid4().hex[:8]}:")
    yield ThreadStore(client, keys, ttl_s=3600)
    for key in client.scan_iter(match=f"{keys.prefix}*"):
        client.delete(key)
    client.close()


def request(run_id: str, prompt: str = "hi") -> dict[str, str]:
    return {"run_id": run_id, "prompt": prompt}


def start(store: ThreadStore, run_id: str) -> None:
    """What `start_run` does right after a claim: store the run's state."""
    store.redis.set(store.keys.state(run_id), "{}")


def end(store: ThreadStore, run_id: str, history: list[Message]) -> dict[str, str] | None:
    store.redis.rpush(store.keys.terminal(run_id), "1")
    return store.release("t", run_id, history, now_ms=NOW)


def test_the_first_claim_starts_the_rest_follow_on_busy(store) -> None:
    first = store.claim("t", "a", "reject", request("a"), now_ms=NOW)
    assert first.claim is Claim.STARTED and first.history == []
    start(store, "a")
    refused = store.claim("t", "b", "reject", request("b"), now_ms=NOW)
    assert refused.claim is Claim.BUSY and refused.active == "a"
    assert store.claim("t", "c", "enqueue", request("c"), now_ms=NOW).claim is Claim.QUEUED
    steered = store.claim("t", "d", "steer", request("d", "look at db-1"), now_ms=NOW)
    assert steered.claim is Claim.STEERED and steered.active == "a"
    assert store.steers("a", after=0) == ["look at db-1"]
    jumps = store.claim("t", "e", "interrupt", request("e"), now_ms=NOW)
    assert jumps.claim is Claim.INTERRUPTS and jumps.active == "a"
    info = store.info("t")
    assert info is not None and info.runs == ["a"] and info.active == "a" and info.queued == 2


def test_an_ended_run_hands_its_history_to_the_queue_head_only(store) -> None:
    store.claim("t", "a", "reject", request("a"), now_ms=NOW)
    start(store, "a")
    store.claim("t", "b", "enqueue", request("b"), now_ms=NOW)
    history = [Message(role="user", content="hi"), Message(role="assistant", content="hello")]
    assert end(store, "a", history) == request("b")
    # Someone else arriving before b's start is delivered finds the thread b's.
    late = store.claim("t", "x", "reject", request("x"), now_ms=NOW)
    assert late.claim is Claim.BUSY and late.active == "b"
    assert late.kick == request("b")  # the head's start is sent again, in case it was lost
    taken = store.claim("t", "b", "enqueue", request("b"), now_ms=NOW)
    assert taken.claim is Claim.STARTED and taken.history == history
    assert store.info("t").runs == ["a", "b"]


def test_a_request_queued_twice_waits_once(store) -> None:
    store.claim("t", "a", "reject", request("a"), now_ms=NOW)
    start(store, "a")
    for _ in range(2):  # a redelivered cmdop.run
        assert store.claim("t", "b", "enqueue", request("b"), now_ms=NOW).claim is Claim.QUEUED
    assert store.info("t").queued == 1


def test_a_claim_whose_run_never_started_expires(store) -> None:
    store.claim("t", "a", "reject", request("a"), now_ms=NOW)  # and its starter died
    assert store.claim("t", "b", "reject", request("b"), now_ms=NOW + 1).claim is Claim.BUSY
    later = NOW + STARTING_GRACE_MS + 1
    assert store.claim("t", "b", "reject", request("b"), now_ms=later).claim is Claim.STARTED


def test_racing_claims_give_the_thread_to_exactly_one(store) -> None:
    outcomes: list[Claim] = []
    gate = threading.Barrier(8)

    def claim(run_id: str) -> None:
        gate.wait()
        outcomes.append(store.claim("t", run_id, "reject", request(run_id), now_ms=NOW).claim)

    racers = [threading.Thread(target=claim, args=(f"r{i}",)) for i in range(8)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert sorted(o.value for o in outcomes) == ["busy"] * 7 + ["started"]


def test_release_by_a_run_that_does_not_hold_the_thread_writes_nothing(store) -> None:
    store.claim("t", "a", "reject", request("a"), now_ms=NOW)
    start(store, "a")
    assert store.release("t", "stranger", [Message(role="user", content="x")], now_ms=NOW) is None
    assert store.history("t") == []
    assert store.info("t").active == "a"


def test_listing_and_deleting(store) -> None:
    for thread_id, at in (("old", NOW), ("new", NOW + 10)):
        store.claim(thread_id, f"{thread_id}-1", "reject", request("x"), now_ms=at)
    assert [info.thread_id for info in store.all(now_ms=NOW + 20)] == ["new", "old"]
    with pytest.raises(ThreadBusy, match="run old-1 is going on it"):
        store.delete("old")  # its run would write it back; a waiting one would be stranded
    start(store, "old-1")
    end_of_old = store.release("old", "old-1", [], now_ms=NOW + 15)
    assert end_of_old is None
    assert store.delete("old") and not store.delete("old")
    assert [info.thread_id for info in store.all(now_ms=NOW + 20)] == ["new"]
    # Past the TTL a thread is no longer listed.
    assert store.all(now_ms=NOW + 10 + 3600 * 1000 + 1) == []


def test_a_redelivered_steer_steers_once_and_an_empty_one_waits_instead(store) -> None:
    store.claim("t", "a", "reject", request("a"), now_ms=NOW)
    start(store, "a")
    for _ in range(2):  # the same steering request delivered twice
        assert (
            store.claim("t", "s", "steer", request("s", "db-1?"), now_ms=NOW).claim is Claim.STEERED
        )
    assert store.steers("a", after=0) == ["db-1?"]
    empty = {"run_id": "e", "messages": [{"role": "user", "content": []}]}
    assert store.claim("t", "e", "steer", empty, now_ms=NOW).claim is Claim.QUEUED


def test_a_follow_up_goes_first_and_a_request_that_cannot_start_is_dropped(store) -> None:
    store.claim("t", "a", "reject", request("a"), now_ms=NOW)
    start(store, "a")
    store.claim("t", "b", "enqueue", request("b"), now_ms=NOW)
    follow_up = request("a-late", "late steer")
    head = store.release("t", "a", [], now_ms=NOW, follow_up=follow_up)
    assert head == follow_up
    assert store.drop_queued("t", "a-late") == request("b")  # say it could not start
    assert store.claim("t", "b", "enqueue", request("b"), now_ms=NOW).claim is Claim.STARTED
