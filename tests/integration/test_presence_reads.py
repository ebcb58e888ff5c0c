"""Presence against a real Redis: a read of an unchanged fleet is one round trip of
O(1) commands whatever its size; a read after a join, a leave or a change reads only
the machines changed (the same commands and keys whatever the fleet's size), and the
whole fleet again only when its version is older than the change log keeps; joins,
leaves, changes and a machine that died without a word are all seen; a heartbeat
renews without rewriting its presence; a presence written by a writer that keeps no
version (an older worker) is still read."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from cmdop_worker.models import MachinePresence, ToolSpec
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.presence import (
    Heartbeat,
    announce,
    fleet_snapshot,
    leave,
    online_machines,
)
from cmdop_worker.state.presence_lua import CHANGES_KEPT_US
from cmdop_worker.surfaces.fleet import RedisServer

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


@pytest.fixture
def private() -> Iterator[redis.Redis]:
    """A Redis of the test's own, so its command counts are the test's alone."""
    server = RedisServer().start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    yield client
    client.close()
    server.stop()


def machine(name: str, *tools: str) -> MachinePresence:
    specs = [ToolSpec(name=t, description=t, input_schema={"type": "object"}) for t in tools]
    return MachinePresence(machine=name, host="h", pid=1, started_ms=0, tools=specs)


def commands(r: redis.Redis) -> dict[str, int]:
    """Calls per command since the last reset (this INFO itself not yet counted)."""
    stats = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


def counted(r: redis.Redis, action) -> dict[str, int]:  # type: ignore[no-untyped-def]
    r.config_resetstat()
    action()
    found = commands(r)
    found.pop("config|resetstat", None)
    return found


def test_a_read_of_an_unchanged_fleet_is_four_o1_commands_whatever_its_size(private) -> None:
    keys = Keys()
    for n in (2, 1000):
        for i in range(n):
            announce(private, keys, machine(f"m-{i:04d}", "shell"), ttl_ms=60_000)
        assert len(online_machines(private, keys)) == n  # read once: the snapshot is held
        seen = counted(private, lambda: online_machines(private, keys))
        assert seen == {"get": 1, "scard": 1, "time": 1, "zrange": 1}, n
        assert fleet_snapshot(private, keys) is fleet_snapshot(private, keys)


def read_cost(r: redis.Redis, keys: Keys) -> tuple[dict[str, int], int]:
    """One read: the commands it sent and the keys they looked up (hits and misses)."""
    r.config_resetstat()
    fleet_snapshot(r, keys)
    found = commands(r)
    found.pop("config|resetstat", None)
    stats = r.info("stats")
    return found, stats["keyspace_hits"] + stats["keyspace_misses"]


def test_a_join_a_leave_and_a_change_cost_a_reader_the_same_whatever_the_fleet_size(
    private,
) -> None:
    costs = {}
    for n in (2, 1000):
        keys = Keys(f"n{n}:")
        for i in range(n):
            announce(private, keys, machine(f"m-{i:04d}", "shell"), ttl_ms=60_000)
        assert len(online_machines(private, keys)) == n  # the reader holds the fleet
        seen = []
        announce(private, keys, machine("joins", "shell"), ttl_ms=60_000)
        seen.append(read_cost(private, keys))
        assert "joins" in names(private, keys)
        leave(private, keys, "m-0001")
        seen.append(read_cost(private, keys))
        assert "m-0001" not in names(private, keys)
        announce(private, keys, machine("m-0000", "shell", "gpu"), ttl_ms=60_000)
        seen.append(read_cost(private, keys))
        changed = {p.machine: p for p in online_machines(private, keys)}["m-0000"]
        assert [t.name for t in changed.tools] == ["shell", "gpu"]
        assert len(online_machines(private, keys)) == n
        for found, _ in seen:
            assert "smembers" not in found and "mget" in found, found
        costs[n] = seen
    assert costs[2] == costs[1000]  # commands and keys looked up, read by read


def test_a_reader_older_than_the_change_log_reads_the_whole_fleet(private) -> None:
    keys = Keys()
    for name in ("a", "b"):
        announce(private, keys, machine(name, "shell"), ttl_ms=60_000)
    held = fleet_snapshot(private, keys)
    # The fleet's versions move on as if more than the log keeps had passed since the
    # reader last read; the next change trims what the reader would need.
    later = int(held.version or 0) + CHANGES_KEPT_US + 1_000_000
    private.set(keys.machines_version, str(later))
    announce(private, keys, machine("c", "shell"), ttl_ms=60_000)
    assert private.zscore(keys.machines_changed, "a") is None  # trimmed
    assert int(private.get(keys.machines_changed_since) or 0) > int(held.version or 0)
    found, _ = read_cost(private, keys)
    assert "smembers" in found  # a full read
    assert names(private, keys) == ["a", "b", "c"]
    announce(private, keys, machine("d", "shell"), ttl_ms=60_000)
    found, _ = read_cost(private, keys)
    assert "smembers" not in found  # caught up again from the fresh version
    assert names(private, keys) == ["a", "b", "c", "d"]


def test_a_change_no_log_holds_is_read_in_full(private) -> None:
    keys = Keys()
    announce(private, keys, machine("a", "shell"), ttl_ms=60_000)
    assert names(private, keys) == ["a"]
    private.delete(keys.machines_changed, keys.machines_changed_since)  # Redis lost the log
    announce(private, keys, machine("a", "gpu"), ttl_ms=60_000)
    (a,) = online_machines(private, keys)
    assert [t.name for t in a.tools] == ["gpu"]


def test_joins_leaves_and_changes_move_the_version_and_are_seen(r, keys) -> None:
    announce(r, keys, machine("a", "shell"), ttl_ms=60_000)
    first = fleet_snapshot(r, keys)
    assert [p.machine for p in first.presences] == ["a"]
    announce(r, keys, machine("b", "shell"), ttl_ms=60_000)  # joins
    second = fleet_snapshot(r, keys)
    assert [p.machine for p in second.presences] == ["a", "b"]
    assert second.version is not None and int(second.version) > int(first.version or 0)
    announce(r, keys, machine("b", "shell", "gpu"), ttl_ms=60_000)  # its tools changed
    (_, b) = fleet_snapshot(r, keys).presences
    assert [t.name for t in b.tools] == ["shell", "gpu"]
    beat = Heartbeat(r, keys, machine("c"), ttl_s=60, refresh_s=1)
    beat.start()
    assert names(r, keys) == ["a", "b", "c"]
    beat.stop()  # leaves
    assert names(r, keys) == ["a", "b"]
    assert r.zscore(keys.machines_alive, "c") is None


def test_a_machine_that_died_reads_offline_once_its_presence_lapses(r, keys) -> None:
    ttl_ms = 400
    announce(r, keys, machine("a"), ttl_ms=60_000)
    announce(r, keys, machine("dies"), ttl_ms=ttl_ms)  # then nothing: SIGKILLed
    before = fleet_snapshot(r, keys)
    assert [p.machine for p in before.presences] == ["a", "dies"]
    give_up = time.monotonic() + 10
    while "dies" in names(r, keys):
        assert time.monotonic() < give_up, "a dead machine still read online"
        time.sleep(0.05)
    assert not r.exists(keys.machine("dies"))  # seen gone no sooner than its key
    assert sorted(r.smembers(keys.machines_index)) == ["a"]
    assert int(fleet_snapshot(r, keys).version or 0) > int(before.version or 0)


def test_a_heartbeat_renews_without_rewriting_its_presence(private) -> None:
    keys = Keys()
    beat = Heartbeat(private, keys, machine("a", "shell"), ttl_s=1.0, refresh_s=0.2)
    beat.update(machine("a", "shell"))  # announced, with no thread: these beats are all

    def beats() -> None:
        for _ in range(8):
            time.sleep(0.2)
            beat.beat()

    version = private.get(keys.machines_version)
    seen = counted(private, beats)
    assert seen.get("pexpire") == 8
    assert "set" not in seen and "evalsha" not in seen  # nothing rewritten, no version moved
    assert 1 <= seen.get("zadd", 0) <= 4  # the lapse time only once it is two beats away
    assert seen.get("sadd", 0) >= 2  # its name, at least every third beat (put back if gone)
    assert private.get(keys.machines_version) == version
    assert 0 < private.pttl(keys.machine("a")) <= 1000
    assert private.zscore(keys.machines_alive, "a") is not None
    assert names(private, keys) == ["a"]


def test_a_heartbeat_that_finds_its_key_gone_announces_again(r, keys) -> None:
    beat = Heartbeat(r, keys, machine("a", "shell"), ttl_s=0.3, refresh_s=30)
    beat.update(machine("a", "shell"))  # no thread: it stalls until the test beats
    version = r.get(keys.machines_version)
    give_up = time.monotonic() + 10
    while names(r, keys):  # its presence lapses while it stalls
        assert time.monotonic() < give_up
        time.sleep(0.05)
    beat.beat()
    assert names(r, keys) == ["a"]
    assert int(r.get(keys.machines_version) or 0) > int(version or 0)


def test_the_version_never_comes_back_to_a_value_a_reader_holds(private) -> None:
    keys = Keys()
    announce(private, keys, machine("a", "shell"), ttl_ms=60_000)
    held = fleet_snapshot(private, keys)
    private.flushdb()  # Redis lost it all (a restore, a flush)
    announce(private, keys, machine("b", "gpu"), ttl_ms=60_000)
    assert int(private.get(keys.machines_version) or 0) > int(held.version or 0)
    assert [p.machine for p in fleet_snapshot(private, keys).presences] == ["b"]


def test_a_presence_written_with_no_version_lapses_too(r, keys) -> None:
    announce(r, keys, machine("a"), ttl_ms=60_000)
    assert names(r, keys) == ["a"]
    register(r, keys, "old", ttl=60)  # an older worker: SET and SADD, nothing else
    assert names(r, keys) == ["a", "old"]
    r.delete(keys.machine("old"))  # its TTL ran out
    give_up = time.monotonic() + 5
    while "old" in names(r, keys):
        assert time.monotonic() < give_up
        time.sleep(0.05)
