"""The machines a fleet has seen, against a real Redis: a machine announcing itself is
remembered with when it was last seen, through a clean leave and through a death
without a word; a name never seen reads unknown (with the closest known names), one
seen but gone reads offline (with when it was last seen); the turn's snapshot carries
the names; a machine's ACL user may write its stamp."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from cmdop_worker.models import MachinePresence
from cmdop_worker.state.acl import machine_rules
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.presence import announce, fleet_snapshot, leave, online_machines
from cmdop_worker.state.seen import known_machines, standing

pytestmark = pytest.mark.integration


@pytest.fixture
def r(redis_server) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"s{uuid.uuid4().hex[:8]}:")


def machine(name: str) -> MachinePresence:
    return MachinePresence(machine=name, host="h", pid=1, started_ms=0, tools=[])


def redis_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_an_announced_machine_is_remembered_after_it_leaves(r, keys) -> None:
    before = redis_ms(r)
    announce(r, keys, machine("alpha"), ttl_ms=60_000)
    assert standing(r, keys, "alpha").standing == "online"
    leave(r, keys, "alpha")
    left = standing(r, keys, "alpha")
    assert left.standing == "offline"
    assert left.last_seen_ms is not None and before <= left.last_seen_ms <= redis_ms(r)
    assert "machine 'alpha' is offline (last seen " in left.said
    (known,) = known_machines(r, keys)
    assert (known.machine, known.online) == ("alpha", False)
    assert known.last_seen_ms == left.last_seen_ms


def test_a_name_never_seen_is_unknown_naming_the_closest_known(r, keys) -> None:
    for name in ("alpha", "alpine", "beta", "zulu"):
        announce(r, keys, machine(name), ttl_ms=60_000)
    leave(r, keys, "alpine")
    typo = standing(r, keys, "alhpa")
    assert typo.standing == "unknown" and typo.last_seen_ms is None
    assert typo.said.startswith("unknown machine 'alhpa': ")
    closest = typo.said.split("closest known names: ")[1].split(", ")
    assert closest[0] == "alpha" and "alpine (offline)" in closest and "zulu" not in closest
    far = standing(r, keys, "qqqqqqqq")
    assert far.standing == "unknown" and "closest" not in far.said
    empty = Keys(f"e{uuid.uuid4().hex[:8]}:")
    assert "no machine has joined it yet" in standing(r, empty, "alpha").said


def test_a_machine_that_died_is_remembered_with_when_its_presence_lapsed(r, keys) -> None:
    announce(r, keys, machine("stays"), ttl_ms=60_000)
    announced = redis_ms(r)
    announce(r, keys, machine("dies"), ttl_ms=300)  # then nothing: SIGKILLed
    give_up = time.monotonic() + 10
    while "dies" in [p.machine for p in online_machines(r, keys)]:
        assert time.monotonic() < give_up, "a dead machine still read online"
        time.sleep(0.05)
    assert r.zscore(keys.machines_alive, "dies") is None  # forgotten by the read
    dead = standing(r, keys, "dies")
    assert dead.standing == "offline"
    assert dead.last_seen_ms is not None
    assert announced + 300 - 50 <= dead.last_seen_ms <= redis_ms(r)  # its lapse, not its start
    listed = {k.machine: k for k in known_machines(r, keys)}
    assert listed["stays"].online and not listed["dies"].online
    assert listed["dies"].last_seen_ms == dead.last_seen_ms


def test_the_fleet_snapshot_carries_every_known_name(r, keys) -> None:
    announce(r, keys, machine("a"), ttl_ms=60_000)
    announce(r, keys, machine("b"), ttl_ms=60_000)
    leave(r, keys, "b")
    snapshot = fleet_snapshot(r, keys)
    assert [p.machine for p in snapshot.presences] == ["a"]
    assert snapshot.known == {"a", "b"}


def test_a_machine_user_may_stamp_its_own_name_and_read_its_own_presence(r, keys) -> None:
    user, password = f"m{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    r.acl_setuser(user, reset=True)  # created, then given the machine's rules
    r.execute_command("ACL", "SETUSER", user, *machine_rules("alpha", password, keys=keys))
    pool = r.connection_pool.connection_kwargs
    as_machine = redis.Redis(host=pool["host"], port=pool["port"], username=user, password=password)
    try:
        announce(as_machine, keys, machine("alpha"), ttl_ms=60_000)
        assert as_machine.get(keys.machine("alpha")) is not None
        leave(as_machine, keys, "alpha")
    finally:
        as_machine.close()
        r.acl_deluser(user)
    assert standing(r, keys, "alpha").standing == "offline"
