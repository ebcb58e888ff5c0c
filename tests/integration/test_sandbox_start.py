"""A machine worker starts sandboxed, or says why not and does not start at all.

- Where bubblewrap cannot start, the worker exits at once naming the cause and the
  way out (`CMDOP_SANDBOX=off`), before it takes any call.
- `CMDOP_SANDBOX=off` starts, warns in its log, and says `off` in its presence and in
  `cmdop-worker machines`.
- `CMDOP_TOOL_USER` runs tool processes as that user, sandboxed or not.
- A machine whose tools have network (unsandboxed ones do) refuses a Redis that answers
  without a password, unless `CMDOP_ALLOW_OPEN_REDIS=1`: then it warns, and its
  presence, `machines` and `machines --json` say "open redis".
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.models import MachinePresence
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import isolated_env, run_tool_calls

pytestmark = pytest.mark.integration

TOOL_USER = "nobody"


@dataclass
class Started:
    fleet: LocalFleet
    client: Client
    fake: FakeAnthropic
    env: dict[str, str]

    def run_on(self, machine: str, command: str) -> str:
        uses = [{"name": "execute_command", "input": {"command": command}}]
        (end,) = run_tool_calls(self.client, self.fake, machine, uses)
        assert end.data["status"] == "ok", end.data
        return str(end.data["output"])


@pytest.fixture(scope="module")
def started(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Started]:
    server = RedisServer().start()
    env = isolated_env(server.url, fake_model, permission_mode="bypass")
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("start-logs"))
    try:
        fleet.start_coordinator()
        # Unsandboxed tools have the network, and this Redis has no password.
        fleet.start_machine("unboxed", {"CMDOP_SANDBOX": "off", "CMDOP_ALLOW_OPEN_REDIS": "1"})
        fleet.start_machine("as-nobody", {"CMDOP_TOOL_USER": TOOL_USER})
        fleet.wait_ready(["unboxed", "as-nobody"], timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield Started(fleet, client, fake_model, env)
    finally:
        fleet.stop()
        server.stop()


def test_a_worker_whose_sandbox_cannot_start_refuses_to_start(started: Started) -> None:
    log = refused_start(started, "no-bwrap", {"CMDOP_BWRAP": "/nonexistent/bwrap"})
    assert "refusing to start" in log and "/nonexistent/bwrap" in log
    assert "CMDOP_SANDBOX=off" in log


def refused_start(started: Started, machine: str, env: dict[str, str]) -> str:
    """The log of a machine worker that had to exit non-zero, never announcing itself."""
    worker = started.fleet.start_machine(machine, env)
    assert worker.process is not None
    code = worker.process.wait(timeout=60)
    del started.fleet.workers[machine]  # gone for good: the fleet's checks must not wait on it
    log = worker.log_path.read_text()
    assert code == 2, log  # refused (exit 2): systemd does not start it again and again
    assert not started.client.redis.exists(started.client.keys.machine(machine))
    return log


def test_sandbox_off_warns_and_shows_in_presence_and_machines(started: Started) -> None:
    raw = started.client.redis.get(started.client.keys.machine("unboxed"))
    assert MachinePresence.model_validate_json(raw).sandbox == "off"
    boxed = MachinePresence.model_validate_json(
        started.client.redis.get(started.client.keys.machine("as-nobody"))
    )
    assert boxed.sandbox == f"bwrap (as {TOOL_USER})"
    assert "CMDOP_SANDBOX=off" in started.fleet.workers["unboxed"].log_path.read_text()
    listing = subprocess.run(
        [sys.executable, "-m", "cmdop_worker.surfaces.cli", "machines"],
        env={**os.environ, "CMDOP_REDIS_URL": started.env["CMDOP_REDIS_URL"], "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    row = next(line for line in listing.splitlines() if "unboxed" in line)
    assert "off" in row


def test_an_open_redis_is_refused_when_tools_have_network(started: Started) -> None:
    log = refused_start(started, "open-refused", {"CMDOP_SANDBOX": "off"})
    assert "refusing to start" in log and "answers without a password" in log
    assert "CMDOP_ALLOW_OPEN_REDIS=1" in log


def test_an_allowed_open_redis_warns_and_shows_in_presence_and_machines(started: Started) -> None:
    raw = started.client.redis.get(started.client.keys.machine("unboxed"))
    assert MachinePresence.model_validate_json(raw).open_redis
    boxed = started.client.redis.get(started.client.keys.machine("as-nobody"))
    assert not MachinePresence.model_validate_json(boxed).open_redis  # its tools: no network
    assert "answers without a password" in started.fleet.workers["unboxed"].log_path.read_text()
    env = {**os.environ, "CMDOP_REDIS_URL": started.env["CMDOP_REDIS_URL"], "COLUMNS": "200"}
    cli = [sys.executable, "-m", "cmdop_worker.surfaces.cli", "machines"]
    listing = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60, check=True)
    row = next(line for line in listing.stdout.splitlines() if "unboxed" in line)
    assert "open redis" in row
    as_json = subprocess.run(
        [*cli, "--json"], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    flags = {m["machine"]: m["open_redis"] for m in json.loads(as_json.stdout)}
    assert flags == {"unboxed": True, "as-nobody": False}


def test_sandbox_off_still_builds_the_tool_environment(started: Started) -> None:
    output = started.run_on("unboxed", "env")
    names = {line.split("=", 1)[0] for line in output.splitlines() if "=" in line}
    assert "CMDOP_REDIS_URL" not in names and "ANTHROPIC_BASE_URL" not in names
    assert "PATH" in names


def test_tool_user_runs_tools_as_that_user(started: Started) -> None:
    output = started.run_on("as-nobody", "id -u")
    assert str(pwd.getpwnam(TOOL_USER).pw_uid) in output.split()


def test_tool_user_has_its_own_groups_not_the_workers(
    started: Started, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A root worker's group 0 would let the tool user read every root:root 0640 file."""
    secret = tmp_path_factory.mktemp("group-secret", numbered=True) / "grp_secret"
    secret.write_text("GROUPSECRET-5521\n")
    os.chown(secret, 0, 0)
    secret.chmod(0o640)
    secret.parent.chmod(0o755)
    assert os.getgid() == 0 or 0 in os.getgroups()  # the worker has group root to leak
    entry = pwd.getpwnam(TOOL_USER)
    expected = {str(g) for g in os.getgrouplist(entry.pw_name, entry.pw_gid)}
    output = started.run_on("as-nobody", f"echo groups: $(id -G); cat {secret} 2>&1 || true")
    (line,) = [line for line in output.splitlines() if line.startswith("groups: ")]
    groups = set(line.split()[1:])
    assert groups == expected, output
    assert "GROUPSECRET" not in output, output


def test_presence_json_names_the_sandbox(started: Started) -> None:
    raw = json.loads(started.client.redis.get(started.client.keys.machine("unboxed")))
    assert raw["sandbox"] == "off"


BROKEN_FILES = {
    "unclosed-array": ('mode = "default"\n[rules]\nallow = ["ls *",\n', ": not valid TOML", ""),
    "bad-mode": ('# a policy\n\nmode = "strcit"\n', ":3: mode: Input should be", "strcit"),
    "bad-table": ('mode = "default"\n[rulez]\nallow = []\n', ":2: rulez: Extra inputs", ""),
}


@pytest.mark.parametrize("problem", [*BROKEN_FILES, "missing"])
def test_a_broken_policy_stops_the_machine_worker_at_start_naming_file_and_line(
    started: Started, problem: str, tmp_path
) -> None:
    path = tmp_path / f"{problem}.toml"
    if problem != "missing":
        text, where, detail = BROKEN_FILES[problem]
        path.write_text(text)
    else:
        where, detail = ": no such file", ""
    log = refused_start(started, f"policy-{problem}", {"CMDOP_POLICY_FILE": str(path)})
    (line,) = [ln for ln in log.splitlines() if ln.startswith("cmdop worker: refusing to start")]
    assert f"{path}{where}" in line and detail in line, line
    assert "cmdop worker ready" not in log


def test_a_bad_agents_file_stops_the_coordinator_at_start(started: Started, tmp_path) -> None:
    path = tmp_path / "agents.toml"
    path.write_text('[agents.ops]\nsystem_prompt = "You run ops."\nmax_turnz = 3\n')
    worker = started.fleet.start_coordinator(
        "bad-agents", extra_env={"CMDOP_AGENTS_FILE": str(path)}
    )
    assert worker.process is not None
    assert worker.process.wait(timeout=60) == 2
    del started.fleet.workers["bad-agents"]
    log = worker.log_path.read_text()
    assert f"refusing to start: {path}:3: agents.ops.max_turnz: Extra inputs" in log, log


def test_a_fault_of_the_machine_worker_is_an_error_outcome_not_a_lost_machine(
    started: Started, tmp_path
) -> None:
    # An audit log that cannot be written (a directory stands in for a full disk).
    audit = tmp_path / "audit-is-a-directory"
    audit.mkdir()
    started.fleet.start_machine("bad-audit", {"CMDOP_AUDIT_LOG": str(audit)})
    started.fleet.wait_ready(["bad-audit"], timeout_s=60)
    uses = [{"name": "execute_command", "input": {"command": "echo hi"}}]
    (end,) = run_tool_calls(started.client, started.fake, "bad-audit", uses)
    assert end.data["status"] == "error", end.data
    output = str(end.data["output"])
    assert output.startswith("bad-audit could not run it: IsADirectoryError"), output
    assert "lost" not in output
