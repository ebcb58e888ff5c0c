"""Machines are known, with real workers: one name is served by one worker, and a name
the fleet never saw is refused where it is named.

- A second machine worker under a live name exits 2 naming the host and pid that hold
  it; a name held on another host is refused whatever its pid; `CMDOP_MACHINE_TAKE_OVER=1`
  starts anyway; a worker restarted at once after a crash (its old presence still live,
  its pid gone) starts.
- `Client.submit` refuses a machine never seen (`InvalidRequest`, the closest known
  names, nothing sent) and accepts one known but offline with a warning.
- A tool call the model makes to a machine never seen is answered "unknown machine"
  with the closest known names, and to a known one that is offline, "offline".
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import MachinePresence
from cmdop_worker.state.presence import announce, leave
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer, WorkerProcess, worker_argv
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import isolated_env, run_tool_calls

pytestmark = pytest.mark.integration

START_S = 60  # a worker's start on a busy machine


@dataclass
class Known:
    fleet: LocalFleet
    client: Client
    fake: FakeAnthropic
    env: dict[str, str]

    def worker(
        self, machine: str, extra: dict[str, str] | None = None, *flags: str
    ) -> WorkerProcess:
        """A machine worker outside the fleet's book (which keeps one per name)."""
        log = self.fleet.logdir / f"{machine}-{uuid.uuid4().hex[:6]}.log"
        env = {**os.environ, **self.fleet.env, **(extra or {})}
        return WorkerProcess(machine, [*worker_argv(machine=machine), *flags], env, log)

    def presence(self, machine: str) -> MachinePresence | None:
        raw = self.client.redis.get(self.client.keys.machine(machine))
        return None if raw is None else MachinePresence.model_validate_json(raw)

    def wait_presence_pid(self, machine: str, pid: int, worker: WorkerProcess) -> None:
        give_up = time.monotonic() + START_S
        while (found := self.presence(machine)) is None or found.pid != pid:
            assert worker.alive(), worker.log_path.read_text()
            assert time.monotonic() < give_up, worker.log_path.read_text()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def known(fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Known]:
    server = RedisServer().start()
    env = isolated_env(server.url, fake_model, permission_mode="bypass")
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("known-logs"))
    try:
        fleet.start_coordinator()
        fleet.start_machine("alpha")
        fleet.wait_ready(["alpha"], timeout_s=START_S)
        with Client(Settings(redis_url=server.url)) as client:
            yield Known(fleet, client, fake_model, env)
    finally:
        fleet.stop()
        server.stop()


def refused(worker: WorkerProcess) -> str:
    """The log of a worker that exited 2 at start."""
    worker.start()
    assert worker.process is not None
    try:
        code = worker.process.wait(timeout=START_S)
    finally:
        worker.kill()
    log = worker.log_path.read_text()
    assert code == 2, log
    return log


def test_a_second_worker_under_a_live_name_refuses_naming_its_holder(known: Known) -> None:
    holder = known.presence("alpha")
    assert holder is not None and holder.pid == known.fleet.workers["alpha"].pid
    log = refused(known.worker("alpha"))
    assert "refusing to start" in log
    assert f"machine name 'alpha' is held by a live worker on host {socket.gethostname()}" in log
    assert f"(pid {holder.pid})" in log and "--take-over" in log
    assert known.presence("alpha") == holder  # the holder untouched, still serving
    assert known.fleet.workers["alpha"].alive()


@pytest.mark.parametrize(
    ("extra", "flags"), [({}, ("--take-over",)), ({"CMDOP_MACHINE_TAKE_OVER": "1"}, ())]
)
def test_a_name_held_on_another_host_is_refused_unless_taken_over(
    known: Known, extra: dict[str, str], flags: tuple[str, ...]
) -> None:
    far = MachinePresence(
        machine="far", host="elsewhere-host", pid=4_194_999, started_ms=0, tools=[]
    )
    announce(known.client.redis, known.client.keys, far, ttl_ms=120_000)
    try:
        # Another host's presence is taken at its word, whatever its pid is here.
        log = refused(known.worker("far"))
        assert "held by a live worker on host elsewhere-host (pid 4194999)" in log
        worker = known.worker("far", extra, *flags).start()
        try:
            known.wait_presence_pid("far", worker.pid, worker)
        finally:
            worker.stop()
    finally:
        leave(known.client.redis, known.client.keys, "far")


def test_a_worker_restarted_at_once_after_a_crash_starts(known: Known) -> None:
    slow_lapse = {"CMDOP_PRESENCE_TTL_S": "120"}  # its old presence certainly still live
    first = known.worker("phoenix", slow_lapse).start()
    known.wait_presence_pid("phoenix", first.pid, first)
    assert f"(pid {first.pid})" in refused(known.worker("phoenix", slow_lapse))  # beside it
    first.kill()  # SIGKILL: no leave
    left_behind = known.presence("phoenix")
    assert left_behind is not None and left_behind.pid == first.pid
    second = known.worker("phoenix", slow_lapse).start()  # this host, its pid gone: starts
    try:
        known.wait_presence_pid("phoenix", second.pid, second)
    finally:
        second.stop()


def test_submit_refuses_a_machine_never_seen_naming_the_closest(known: Known) -> None:
    run_id = uuid.uuid4().hex
    with pytest.raises(InvalidRequest) as refusal:
        known.client.submit(prompt="hello", machine="alhpa", run_id=run_id)
    said = str(refusal.value)
    assert said.startswith("machine: unknown machine 'alhpa': ")
    assert "closest known names: alpha" in said
    assert not known.client.redis.exists(known.client.keys.start(run_id))  # nothing sent


def test_submit_accepts_a_known_offline_machine_with_a_warning(known: Known) -> None:
    gone = MachinePresence(machine="gone-box", host="h", pid=1, started_ms=0, tools=[])
    announce(known.client.redis, known.client.keys, gone, ttl_ms=60_000)
    leave(known.client.redis, known.client.keys, "gone-box")
    name = f"hi{uuid.uuid4().hex[:8]}"
    known.fake.add_script(name, [[{"type": "text", "text": "hello"}]])
    run = known.client.submit(prompt=f"[[script:{name}]] hi", machine="gone-box", timeout_s=60)
    (warning,) = run.warnings
    assert warning.startswith("machine 'gone-box' is offline (last seen ")
    assert run.wait(timeout=90).status == "done"
    online = known.client.submit(prompt=f"[[script:{name}]] hi", machine="alpha", timeout_s=60)
    assert online.warnings == ()
    assert online.wait(timeout=90).status == "done"


def test_a_call_to_a_machine_never_seen_is_unknown_not_offline(known: Known) -> None:
    gone = MachinePresence(machine="gone-box", host="h", pid=1, started_ms=0, tools=[])
    announce(known.client.redis, known.client.keys, gone, ttl_ms=60_000)
    leave(known.client.redis, known.client.keys, "gone-box")
    uses = [
        {"name": "execute_command", "input": {"machine": "alhpa", "command": "true"}},
        {"name": "execute_command", "input": {"machine": "gone-box", "command": "true"}},
    ]
    typo, offline = (e.data for e in run_tool_calls(known.client, known.fake, "alpha", uses))
    assert typo["is_error"] and typo["status"] == "invalid"
    assert typo["output"].startswith("unknown machine 'alhpa': ")
    assert "closest known names: alpha" in typo["output"]
    assert offline["is_error"] and offline["status"] == "offline"
    assert offline["output"].startswith("machine gone-box is offline")
