"""An outside tester's attacks on the watchdog's set, with one machine's credentials.

Machines may write `<prefix>deadlines` (a machine's record of an outcome hands a
turn's deadline past the next call it hands out), so a machine can move any entry to
0, naming a run it heard of. The watchdog must not take the score for proof that an
entry is due. Each attack is replayed through real parts: a Redis with a password,
the coordinator on the admin user, two machine workers each logged in as its own ACL
user (`cmdop-worker acl`'s line, as `test_redis_acl` makes them); `wd-thief`'s
credentials write the entry, `wd-victim` runs the call, held open by a FIFO the test
writes to when it is done looking:

- `run:<id>` at 0: the run is not cancelled as timed out; its entry goes back to
  the run's deadline and the run ends done with its call's output;
- `turn:<id>:<n>` at 0: the call in flight is not answered "machine lost";
- `approval:<id>:<call>` at 0: the parked call is not expired and its entry goes
  back to its expiry (the close script judges the expiry by Redis's clock: this one
  held before, and is kept as a guard); a person's approval still runs it;
- `probe:<id>:<n>` at 0, twice, while the victim misses one heartbeat (its worker
  stopped until its presence lapses, then let go): its call is not answered "machine
  lost", as two probes a presence TTL apart would have it;
- `advance:<id>:<n+1>` at 0 while turn n waits for its call: turn n+1 does not start
  without the call's result.

That the watchdog has handled the attacker's entry is known without a clock: a
harmless entry (`cancel:` of no run) is written after it with a higher score, and the
watchdog claims and handles entries in score order.

The fleet is its own (not the package's `attack_base`): only it has ACL users.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.models import Event
from cmdop_worker.state.connect import now_ms
from cmdop_worker.surfaces.client import Run
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..test_redis_acl import KEYS, AclFleet, acl_fleet, command, events_until, reply

pytestmark = pytest.mark.integration

THIEF, VICTIM = "wd-thief", "wd-victim"
POLICY = """
mode = "default"
[rules]
allow = ["execute_command(cat *)"]
[sandbox]
writable = ["/tmp"]
approved_writable = ["/tmp"]
"""


@pytest.fixture(scope="module")
def wd(fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclFleet]:
    workdir = tmp_path_factory.mktemp("watchdog-attacks")
    (workdir / "policy.toml").write_text(POLICY)
    settings = {"policy_file": str(workdir / "policy.toml"), "permission_mode": "default"}
    with acl_fleet(fake_model, workdir, (THIEF, VICTIM), approval_timeout_s="300", **settings) as f:
        yield f


def held_call(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A call on the victim that runs until the test writes its FIFO (`release`)."""
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    return fifo, command(VICTIM, f"cat {fifo}")


def release(fifo: Path) -> None:
    for _ in range(600):  # ENXIO: the call is not reading it yet (its sandbox starting)
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise AssertionError("the call never read its FIFO")
    try:
        os.write(fd, b"slept\n")
    finally:
        os.close(fd)


def moved_to_zero(wd: AclFleet, member: str) -> None:
    """The attack: the thief's credentials move `member` to 0. Returns once the
    watchdog has handled it."""
    thief = wd.as_machine(THIEF)
    thief.zadd(KEYS.deadlines, {member: 0})
    thief.close()
    after = f"cancel:after-{secrets.token_hex(6)}"
    wd.client.redis.zadd(KEYS.deadlines, {after: 1})
    for _ in range(1200):
        if wd.client.redis.zscore(KEYS.deadlines, after) is None:
            return
        time.sleep(0.05)
    raise AssertionError("the watchdog never handled the entries")


def started(run: Run[Any]) -> Event:
    return events_until(run, lambda e: e.type == "TOOL_START")


def ends(wd: AclFleet, run: Run[Any]) -> list[dict[str, Any]]:
    return [e.data for e in wd.client.events_so_far(run.run_id) if e.type == "TOOL_END"]


def finished_with_output(wd: AclFleet, run: Run[Any], fifo: Path) -> None:
    release(fifo)
    result = run.wait(timeout=90, raise_on_failure=False)
    assert result.status == "done", result
    (end,) = ends(wd, run)
    assert end["status"] == "ok", end
    assert "slept" in str(end["output"])


def test_a_machine_cannot_time_a_run_out_early(wd: AclFleet, tmp_path: Path) -> None:
    fifo, call = held_call(tmp_path)
    run = wd.submit([[call], reply("over")])  # timeout_s=120
    started(run)
    moved_to_zero(wd, f"run:{run.run_id}")
    assert wd.client.redis.get(KEYS.run(run.run_id, "cancel")) is None
    back = wd.client.redis.zscore(KEYS.deadlines, f"run:{run.run_id}")
    assert back is not None and back > now_ms() + 60_000  # at the run's deadline again
    finished_with_output(wd, run, fifo)


def test_a_machine_cannot_end_a_turn_early(wd: AclFleet, tmp_path: Path) -> None:
    fifo, call = held_call(tmp_path)
    run = wd.submit([[call], reply("over")])
    turn = started(run).turn
    member = f"turn:{run.run_id}:{turn}"
    moved_to_zero(wd, member)
    assert ends(wd, run) == []  # not answered "machine lost"
    back = wd.client.redis.zscore(KEYS.deadlines, member)
    assert back is not None and back > now_ms() + 30_000  # at its calls' deadline again
    finished_with_output(wd, run, fifo)


def test_a_machine_cannot_start_the_next_turn_early(wd: AclFleet, tmp_path: Path) -> None:
    fifo, call = held_call(tmp_path)
    run = wd.submit([[call], reply("over")])
    turn = started(run).turn
    member = f"advance:{run.run_id}:{turn + 1}"
    moved_to_zero(wd, member)
    # Dropped: it is the barrier's to schedule once the turn has its outcome (an
    # enqueue of the next turn would have kept it, to look again a lease later).
    assert wd.client.redis.zscore(KEYS.deadlines, member) is None
    assert ends(wd, run) == []
    assert run.result() is None  # the next turn did not run without the call's result
    finished_with_output(wd, run, fifo)


def test_a_machine_cannot_expire_a_parked_call_early(wd: AclFleet, tmp_path: Path) -> None:
    marker = tmp_path / "approved"
    run = wd.submit([[command(VICTIM, f"touch {marker}")], reply("over")])
    asked = events_until(run, lambda e: e.type == "APPROVAL_REQUEST")
    call_id = asked.data["tool_call_id"]
    member = f"approval:{run.run_id}:{call_id}"
    moved_to_zero(wd, member)
    assert ends(wd, run) == []  # not denied "nobody approved within 300 s"
    back = wd.client.redis.zscore(KEYS.deadlines, member)
    assert back is not None and back > now_ms() + 60_000  # at its expiry again, not lost
    run.approve(call_id, approve=True, by="ann")
    result = run.wait(timeout=90, raise_on_failure=False)
    assert result.status == "done", result
    (end,) = ends(wd, run)
    assert end["status"] == "ok", end
    assert marker.exists()


def test_a_machine_cannot_rush_the_probes_of_another(wd: AclFleet, tmp_path: Path) -> None:
    fifo, call = held_call(tmp_path)
    run = wd.submit([[call], reply("over")])
    turn = started(run).turn
    victim = wd.fleet.workers[VICTIM]
    victim.signal(signal.SIGSTOP)
    try:
        for _ in range(600):
            if VICTIM not in {m.machine for m in wd.client.machines()}:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the stopped machine never lapsed")
        moved_to_zero(wd, f"probe:{run.run_id}:{turn}")
        moved_to_zero(wd, f"probe:{run.run_id}:{turn}")
    finally:
        victim.signal(signal.SIGCONT)
    assert ends(wd, run) == []  # not answered "machine lost"
    finished_with_output(wd, run, fifo)
