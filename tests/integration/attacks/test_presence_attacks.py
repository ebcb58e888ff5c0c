"""One machine's Redis credentials against the fleet's presence keys, replayed through
real parts: a redis-server with a password, each machine worker logged in as its own
ACL user (`cmdop-worker acl --machine`'s line, fed to `redis-cli`), a coordinator on the
admin user. The attacker holds the victim's neighbour's credentials only: what a
compromised machine has. Each attempt writes what that ACL user may write; the fleet
must still answer for the victim.

- 1a: `SREM` of the victim's name from the index: its own heartbeat puts it back, so
  `cmdop-worker machines` lists it again and a run addressed to it completes there.
- 1b/1c: a machine writes its own presence key naming the victim (with labels and a
  pid of its liking) and moves the version on: readers leave that presence out, so
  the victim is listed once with its own labels and a selector's fan-out reaches only
  the machines whose own presence matches it, never the victim.
- 1d: a version that is no number (`SET machines:version abc`), then a real change in
  the fleet: every coordinator turn still completes, and nothing is refused in its log.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from cmdop_worker.config import Settings
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.state.keys import Keys
from cmdop_worker.surfaces.client import Client, Run
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ...conftest import isolated_env
from ..test_redis_acl import ADMIN_PW, CLI, create_user, refused_by_acl

pytestmark = pytest.mark.integration

KEYS = Keys()
# The tester's fleet: the victim beta is a prod db; alpha and gamma its neighbours.
LABELS = {
    "alpha": ["role=web", "env=prod"],
    "beta": ["role=db", "env=prod"],
    "gamma": ["role=web", "env=dev"],
}


@dataclass
class PresenceFleet:
    server: RedisServer
    fleet: LocalFleet
    client: Client
    fake: FakeAnthropic
    passwords: dict[str, str]

    def as_machine(self, machine: str) -> redis.Redis:
        """A client with `machine`'s credentials only, as the attacker holds them."""
        url = self.server.url_for(f"machine-{machine}", self.passwords[machine])
        return redis.Redis.from_url(url, decode_responses=True)

    def listed(self) -> list[dict[str, Any]]:
        """`cmdop-worker machines --json`, run as an operator runs it."""
        env = {**self.fleet.env, "CMDOP_REDIS_URL": self.server.url}
        done = subprocess.run(
            [CLI, "machines", "--json"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        rows: list[dict[str, Any]] = json.loads(done.stdout)
        return rows

    def coordinator_log(self) -> str:
        return self.fleet.workers["coordinator"].log_path.read_text(errors="replace")

    def submit(self, turns: list[Any], **fields: Any) -> Run[Any]:
        name = f"pres{secrets.token_hex(5)}"
        self.fake.add_script(name, turns)
        return self.client.submit(prompt=f"[[script:{name}]] go", timeout_s=120, **fields)


@pytest.fixture(scope="module")
def pf(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PresenceFleet]:
    workdir = tmp_path_factory.mktemp("presence-attacks")
    with presence_fleet(fake_model, workdir) as fleet:
        yield fleet


@contextmanager
def presence_fleet(fake: FakeAnthropic, workdir: Path) -> Iterator[PresenceFleet]:
    server = RedisServer(password=ADMIN_PW).start()
    passwords = {m: secrets.token_urlsafe(16) for m in LABELS}
    env = isolated_env(server.url, fake, permission_mode="bypass")
    fleet = LocalFleet(env, logdir=workdir)
    try:
        for machine, password in passwords.items():
            create_user(server, machine, password, workdir)
        fleet.start_coordinator()
        for machine, labels in LABELS.items():
            url = server.url_for(f"machine-{machine}", passwords[machine])
            fleet.start_machine(machine, {"CMDOP_REDIS_URL": url}, labels=labels)
        fleet.wait_ready(list(LABELS), timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield PresenceFleet(server, fleet, client, fake, passwords)
    finally:
        fleet.stop()
        server.close()


@pytest.fixture(autouse=True)
def whole_fleet(pf: PresenceFleet) -> Iterator[None]:
    """Each attack starts from, and leaves, every machine listed once with its labels
    (a forged presence is put back by rewriting it as its worker wrote it)."""
    wait_listed(pf, set(LABELS))
    yield
    wait_listed(pf, set(LABELS))


def labels_of(row: dict[str, Any]) -> list[str]:
    return sorted(f"{k}={v}" for k, v in row["labels"].items())


def wait_listed(pf: PresenceFleet, machines: set[str], timeout_s: float = 30) -> None:
    """Until `machines` lists each of `machines` once, with its own labels."""
    give_up = time.monotonic() + timeout_s
    while True:
        rows = pf.listed()
        names = [row["machine"] for row in rows]
        if set(names) == machines and len(names) == len(machines):
            assert all(labels_of(r) == sorted(LABELS[r["machine"]]) for r in rows), rows
            return
        assert time.monotonic() < give_up, f"the fleet never read {sorted(machines)}: {rows}"
        time.sleep(0.25)


def command(text: str, **where: str) -> dict[str, Any]:
    return {"type": "tool_use", "name": "execute_command", "input": {**where, "command": text}}


def reply(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]


def starts_and_ends(pf: PresenceFleet, run: Run[Any]) -> tuple[set[str], dict[str, Any]]:
    events = pf.client.events_so_far(run.run_id)
    # (a call no machine answers, a selector that matches none, starts on no machine)
    started = {e.data["machine"] for e in events if e.type == "TOOL_START" and e.data["machine"]}
    ended = {e.data["machine"]: e.data for e in events if e.type == "TOOL_END"}
    return started, ended


def run_on(pf: PresenceFleet, machine: str) -> dict[str, Any]:
    """A run whose one call goes to `machine`: done, and what that call answered."""
    marker = f"ran-{secrets.token_hex(4)}"
    run = pf.submit([[command(f"echo {marker}", machine=machine)], reply("over")])
    result = run.wait(timeout=120)
    assert result.status == "done", result
    started, ended = starts_and_ends(pf, run)
    assert started == {machine}, started
    assert ended[machine]["status"] == "ok", ended
    assert marker in str(ended[machine]["output"])
    return ended[machine]


def test_a_neighbour_removing_the_victim_from_the_index_lasts_at_most_a_beat_or_two(
    pf: PresenceFleet,
) -> None:
    pf.client.redis.execute_command("ACL", "LOG", "RESET")
    attacker = pf.as_machine("alpha")
    assert attacker.srem(KEYS.machines_index, "beta") == 1  # the ACL lets it (1a)
    # beta's heartbeat puts it back; the reads in between may or may not have missed it
    wait_listed(pf, set(LABELS), timeout_s=20)
    assert pf.client.redis.sismember(KEYS.machines_index, "beta")
    run_on(pf, "beta")
    worker_log = pf.fleet.workers["beta"].log_path.read_text(errors="replace")
    assert "beta was missing from the fleet's index: put back" in worker_log
    assert refused_by_acl(pf) == []  # the version moved on by beta's own credentials


def test_a_neighbour_removing_every_name_again_and_again_never_takes_the_victim_away(
    pf: PresenceFleet,
) -> None:
    attacker = pf.as_machine("alpha")
    for _ in range(5):  # 1a, repeated: each removal is undone within a beat or two
        attacker.srem(KEYS.machines_index, *LABELS)
        time.sleep(0.3)
    wait_listed(pf, set(LABELS), timeout_s=20)
    run_on(pf, "beta")


def forge(pf: PresenceFleet, attacker: str, labels: dict[str, str]) -> str:
    """The attacker's own presence key rewritten to name beta, with `labels` (1b/1c), and
    the version moved on so readers read it. Returns the original, to put back."""
    thief = pf.as_machine(attacker)
    key = KEYS.machine(attacker)
    original = thief.get(key)
    assert original is not None
    forged = dict(json.loads(original), machine="beta", labels=labels)
    assert thief.set(key, json.dumps(forged), keepttl=True)
    thief.incr(KEYS.machines_version)
    return original


def put_back(pf: PresenceFleet, attacker: str, original: str) -> None:
    key = KEYS.machine(attacker)
    pf.client.redis.set(key, original, keepttl=True)
    pf.client.redis.incr(KEYS.machines_version)


@pytest.mark.parametrize("attacker", ["alpha", "gamma"], ids=["sorts-before", "sorts-after"])
def test_a_presence_naming_another_machine_is_left_out(pf: PresenceFleet, attacker: str) -> None:
    original = forge(pf, attacker, {"role": "web", "env": "dev", "owner": "attacker"})
    try:
        # the forged presence is read no more as beta, nor as anyone
        give_up = time.monotonic() + 20
        while attacker in {row["machine"] for row in pf.listed()}:
            assert time.monotonic() < give_up, "the forged presence was never read"
            time.sleep(0.25)
        rows = pf.listed()
        betas = [row for row in rows if row["machine"] == "beta"]
        assert len(betas) == 1, rows
        assert labels_of(betas[0]) == sorted(LABELS["beta"])
        # a selector the forged labels match reaches nobody; one the victim's real
        # labels do not match never reaches it
        run = pf.submit(
            [
                [
                    command("echo owned", machines="owner=attacker"),
                    command("echo dev-work", machines="env=dev"),
                    command("echo web-work", machines="role=web"),
                ],
                reply("over"),
            ]
        )
        assert run.wait(timeout=120).status == "done"
        started, _ = starts_and_ends(pf, run)
        honest = {m for m, labels in LABELS.items() if m != attacker and "role=web" in labels}
        assert started == honest, started  # role=web's honest machines; beta never
        coordinator = pf.coordinator_log()
        assert f"ignoring machine presence {KEYS.machine(attacker)}" in coordinator
    finally:
        put_back(pf, attacker, original)


@pytest.mark.parametrize("junk", ["abc", "1e400", "9" * 40])
def test_a_version_that_is_no_number_never_stops_a_turn(pf: PresenceFleet, junk: str) -> None:
    attacker = pf.as_machine("alpha")
    assert attacker.set(KEYS.machines_version, junk)  # 1d, step 1
    run_on(pf, "beta")  # read while the version is junk
    # step 2: a real change in the fleet (alpha's key gone: its heartbeat announces again)
    attacker.delete(KEYS.machine("alpha"))
    give_up = time.monotonic() + 20
    while not pf.client.redis.exists(KEYS.machine("alpha")):
        assert time.monotonic() < give_up, "alpha never announced itself again"
        time.sleep(0.1)
    assert pf.client.redis.get(KEYS.machines_version).isdigit()  # the scripts mend it
    run_on(pf, "beta")  # step 3: every later turn
    run_on(pf, "gamma")
    assert attacker.set(KEYS.machines_version, junk)  # and junk that stays
    run_on(pf, "alpha")
    run_on(pf, "beta")
    assert "is not a float" not in pf.coordinator_log()
    pf.client.redis.set(KEYS.machines_version, str(time.time_ns() // 1000))  # mended


def test_names_that_are_no_utf8_never_stop_a_turn(pf: PresenceFleet) -> None:
    """Beyond the tester's list: bytes a decoding client cannot read, in every set a
    machine may add to, and in its own presence key."""
    url = pf.server.url_for("machine-alpha", pf.passwords["alpha"])
    attacker = redis.Redis.from_url(url)  # raw bytes
    junk = b"\xff\xfe-junk"
    attacker.sadd(KEYS.machines_index, junk)
    attacker.zadd(KEYS.machines_alive, {junk: 0})
    attacker.zadd(KEYS.machines_seen, {junk: 0})
    attacker.zadd(KEYS.machines_changed, {junk: 2**52})
    attacker.incr(KEYS.machines_version)
    try:
        run_on(pf, "beta")
        run_on(pf, "gamma")
        rows = {row["machine"] for row in pf.listed()}
        assert set(LABELS) <= rows
    finally:
        admin = redis.Redis.from_url(pf.server.url)
        admin.srem(KEYS.machines_index, junk)
        admin.zrem(KEYS.machines_alive, junk)
        admin.zrem(KEYS.machines_seen, junk)
        admin.zrem(KEYS.machines_changed, junk)
        admin.incr(KEYS.machines_version)


@pytest.mark.parametrize(
    "forged",
    [
        "[" * 200_000 + "]" * 200_000,  # nested past any parser's recursion
        "x" * 2_000_000,  # over the size any reader parses
        json.dumps({"machine": "alpha", "labels": {"role": "web\nbreak"}}),  # no label
    ],
    ids=["nested", "huge", "bad-label"],
)
def test_a_presence_no_reader_can_use_is_left_out_and_no_turn_stops(
    pf: PresenceFleet, forged: str
) -> None:
    thief = pf.as_machine("alpha")
    key = KEYS.machine("alpha")
    original = thief.get(key)
    assert original is not None
    assert thief.set(key, forged, keepttl=True)
    thief.incr(KEYS.machines_version)
    try:
        run_on(pf, "beta")  # the coordinator reads every presence, alpha's too
        rows = {row["machine"] for row in pf.listed()}  # and so does the CLI
        assert {"beta", "gamma"} <= rows and "alpha" not in rows, rows
    finally:
        put_back(pf, "alpha", original)


@pytest.mark.parametrize("key", [KEYS.machines_index, KEYS.machines_alive, KEYS.machines_seen])
def test_a_fleet_wide_key_of_the_wrong_type_never_stops_a_turn(pf: PresenceFleet, key: str) -> None:
    thief = pf.as_machine("alpha")
    admin = pf.client.redis
    kind = admin.type(key)
    saved = admin.dump(key)
    assert thief.delete(key) == 1 and thief.set(key, "not a set")
    thief.incr(KEYS.machines_version)
    try:
        run = pf.submit([[{"type": "text", "text": "still answering"}]])
        assert run.wait(timeout=120).text == "still answering"  # the turn did not fail
        assert "Traceback" not in pf.coordinator_log().split("still answering")[-1]
    finally:
        admin.delete(key)
        if saved is not None:
            admin.restore(key, 0, saved)
        assert admin.type(key) == kind
        admin.incr(KEYS.machines_version)


def test_a_seen_name_that_is_no_utf8_breaks_no_submit_nor_listing(pf: PresenceFleet) -> None:
    url = pf.server.url_for("machine-alpha", pf.passwords["alpha"])
    attacker = redis.Redis.from_url(url)  # raw bytes
    junk = b"\xff\xfe-seen"
    attacker.zadd(KEYS.machines_seen, {junk: 0})
    try:
        with pytest.raises(InvalidRequest, match="unknown machine 'alhpa'"):
            pf.client.submit(prompt="hello", machine="alhpa")
        env = {**pf.fleet.env, "CMDOP_REDIS_URL": pf.server.url}
        listing = subprocess.run(
            [CLI, "machines", "--all", "--json"], env=env, capture_output=True, text=True
        )
        assert listing.returncode == 0, listing.stderr
        assert set(LABELS) <= {row["machine"] for row in json.loads(listing.stdout)}
    finally:
        redis.Redis.from_url(pf.server.url).zrem(KEYS.machines_seen, junk)
