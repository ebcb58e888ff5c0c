"""`online_machines` against a real Redis: one round trip when the names are as last
read, and the live set, never the guess, decides what is returned."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from cmdop_worker.models import MachinePresence
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.presence import online_machines

pytestmark = pytest.mark.integration


@pytest.fixture
def r(redis_server) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"p{uuid.uuid4().hex[:8]}:")


def register(r: redis.Redis, keys: Keys, name: str, raw: str | None = None, ttl: int = 60) -> None:
    presence = MachinePresence(machine=name, host="h", pid=1, started_ms=0, tools=[])
    r.set(keys.machine(name), raw if raw is not None else presence.model_dump_json(), ex=ttl)
    r.sadd(keys.machines_index, name)


def names(r: redis.Redis, keys: Keys) -> list[str]:
    return [p.machine for p in online_machines(r, keys)]


def test_a_machine_that_joins_between_reads_is_seen(r, keys) -> None:
    register(r, keys, "a")
    assert names(r, keys) == ["a"]
    register(r, keys, "b")  # the guess ("a") is now wrong
    assert names(r, keys) == ["a", "b"]
    assert names(r, keys) == ["a", "b"]  # read with the guess, which is right again


def test_an_expired_machine_is_dropped_from_the_set(r, keys) -> None:
    register(r, keys, "a")
    register(r, keys, "b")
    assert names(r, keys) == ["a", "b"]
    r.delete(keys.machine("b"))  # as its key's TTL would
    assert names(r, keys) == ["a"]
    assert sorted(r.smembers(keys.machines_index)) == ["a"]


def test_an_unreadable_presence_is_left_out_and_the_rest_read(r, keys) -> None:
    register(r, keys, "a")
    register(r, keys, "b", raw="{not json")
    assert names(r, keys) == ["a"]
    assert names(r, keys) == ["a"]


def test_two_servers_with_the_same_names_each_answer_for_themselves(r, keys, tmp_path) -> None:
    from cmdop_worker.surfaces.fleet import RedisServer

    other_server = RedisServer().start()
    other = redis.Redis.from_url(other_server.url, decode_responses=True)
    try:
        register(r, keys, "a")
        register(other, keys, "a", raw="{broken")
        assert names(r, keys) == ["a"]
        assert names(other, keys) == []  # not the first server's value, read with its guess
        assert names(r, keys) == ["a"]
    finally:
        other.close()
        other_server.stop()
