"""A machine worker installed as docs/install-machine.md says: from a built wheel, in a
fresh virtualenv, under the systemd units of `deploy/systemd/`, configured by its
environment file.

The wheel is built once (`python -m build`) and installed with its dependencies into a
new venv (the packages come from the index: no pip cache is assumed), so the module
takes about a minute; it is marked `slow`. The units are checked by `systemd-analyze
verify` where it is installed (Debian's `systemd` package).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cmdop_worker.surfaces.fleet import RedisServer
from tests.conftest import repo_root

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

DEPLOY = repo_root() / "deploy" / "systemd"
UNITS = ("cmdop-machine@.service", "cmdop-coordinator.service", "cmdop-gateway.service")
INSTALL_PREFIX = "/opt/cmdop-worker"  # where the units and the doc put the venv
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path

    @property
    def cli(self) -> str:
        return str(self.venv / "bin" / "cmdop-worker")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel built from this tree, installed with its dependencies in a new venv."""
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(repo_root())]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("cmdop_worker-*.whl")
    venv = tmp_path_factory.mktemp("venv") / "cmdop-worker"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "pip"), "install", "--quiet", str(wheel)]
    subprocess.run(pip, check=True, capture_output=True, timeout=480)
    return Installed(wheel, venv)


def test_the_installed_command_reports_the_wheels_version(installed: Installed) -> None:
    version = installed.wheel.name.split("-")[1]
    done = subprocess.run(
        [installed.cli, "--version"], capture_output=True, text=True, timeout=60, env=_bare_env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"cmdop-worker {version}"


def test_the_wheel_carries_the_viewers_static_files(installed: Installed) -> None:
    static = repo_root() / "cmdop_worker" / "surfaces" / "static"
    expected = {f"cmdop_worker/surfaces/static/{p.name}" for p in static.iterdir() if p.is_file()}
    assert expected, "the viewer has no static files in the source tree"
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    assert expected <= names, sorted(expected - names)
    site = next((installed.venv / "lib").glob("python3*/site-packages"))
    for name in expected:
        assert (site / name).is_file(), name


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian: apt-get install systemd)",
)
def test_the_units_pass_systemd_analyze_verify(installed: Installed, tmp_path: Path) -> None:
    """Clean: no error and no warning (an unknown key is only a warning, exit 0). The
    units' /opt/cmdop-worker is pointed at the venv built here, whose command verify
    requires to exist."""
    for unit in UNITS:
        text = (DEPLOY / unit).read_text()
        assert f"ExecStart={INSTALL_PREFIX}/bin/cmdop-worker " in text, unit
        (tmp_path / unit).write_text(text.replace(INSTALL_PREFIX, str(installed.venv)))
    targets = [str(tmp_path / u.replace("@.", "@web-1.")) for u in UNITS]
    done = subprocess.run(
        ["systemd-analyze", "verify", *targets], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "" and done.stdout.strip() == "", done.stderr + done.stdout


def test_a_unit_key_systemd_does_not_know_is_caught(installed: Installed, tmp_path: Path) -> None:
    """The check above can fail: a misspelt hardening option is reported."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    text = (DEPLOY / "cmdop-coordinator.service").read_text()
    text = text.replace("ProtectHome=yes", "ProtectHomes=yes").replace(
        INSTALL_PREFIX, str(installed.venv)
    )
    unit = tmp_path / "cmdop-coordinator.service"
    unit.write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=120
    )
    assert "ProtectHomes" in done.stderr


# systemd.exec(5), EnvironmentFile=: a line is `KEY=VALUE`; `#` and `;` start comments.
# The example keeps to the subset every reader agrees on: no quotes, no backslashes,
# no `export`, no spaces around `=`.
_ASSIGNMENT = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>[^\s'\"\\]*)")


def environment_file(text: str) -> dict[str, str]:
    """The variables of a systemd environment file kept to the portable subset; a line
    outside it is an error naming it."""
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith(("#", ";")):
            continue
        match = _ASSIGNMENT.fullmatch(line)
        if match is None:
            raise ValueError(f"line {number} is not a plain KEY=VALUE: {line!r}")
        found[match["key"]] = match["value"]
    return found


@pytest.mark.parametrize(
    "line", ["export A=1", "A = 1", "A='one two'", 'A="x"', "A=a\\", "1A=x", "A=x y"]
)
def test_the_environment_file_reader_refuses_what_is_not_portable(line: str) -> None:
    with pytest.raises(ValueError, match="line 2"):
        environment_file(f"# comment\n{line}\n")


def test_the_example_environment_file_is_plain_and_names_the_redis_url() -> None:
    env = environment_file((DEPLOY / "env.example").read_text())
    assert env["CMDOP_REDIS_URL"].startswith("redis://")
    assert env["CMDOP_POLICY_FILE"] == "/etc/cmdop-worker/policy.toml"


@pytest.fixture(scope="module")
def fleet_redis() -> Iterator[RedisServer]:
    server = RedisServer(password=f"install-{uuid.uuid4().hex[:12]}").start()
    yield server
    server.stop()


def test_a_worker_started_from_the_environment_file_joins_the_fleet(
    installed: Installed, fleet_redis: RedisServer, tmp_path: Path
) -> None:
    """The example file, with its Redis URL (and password) pointed at a test Redis and
    its paths at this tree, is all a machine worker started from the venv is given: it
    comes up on that Redis, sandboxed, and `cmdop-worker machines` lists it there."""
    text = (DEPLOY / "env.example").read_text()
    text = re.sub(r"(?m)^CMDOP_REDIS_URL=.*$", f"CMDOP_REDIS_URL={fleet_redis.url}", text)
    policy = repo_root() / "config" / "policy.example.toml"
    text = text.replace("/etc/cmdop-worker/policy.toml", str(policy))
    env = {**_bare_env(home=tmp_path), **environment_file(text)}
    env["CMDOP_AUDIT_LOG"] = str(tmp_path / "audit.jsonl")  # the unit's Environment=
    machine = f"install-{uuid.uuid4().hex[:8]}"
    work = tmp_path / machine
    work.mkdir()
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [installed.cli, "worker", "--machine", machine],
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # Asked with the test Redis's URL given outright: the worker found it only in the file.
        asking = {**_bare_env(home=tmp_path), "CMDOP_REDIS_URL": fleet_redis.url}
        listed = _wait_listed(installed, asking, machine, worker)
        assert listed is not None, (tmp_path / "worker.log").read_text()[-4000:]
        assert listed["sandbox"] == "bwrap", listed
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()


def _wait_listed(
    installed: Installed, env: dict[str, str], machine: str, worker: subprocess.Popen[bytes]
) -> dict[str, object] | None:
    """The machine's entry in `cmdop-worker machines --json` once it is there; None if
    the worker exits or the deadline passes first."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and worker.poll() is None:
        done = subprocess.run(
            [installed.cli, "machines", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        for entry in json.loads(done.stdout):
            if entry.get("machine") == machine:
                return dict(entry)
        time.sleep(0.5)
    return None


def _bare_env(home: Path | None = None) -> dict[str, str]:
    """What systemd gives a service: a plain PATH, no virtualenv, no CMDOP_ variables."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
    }
    if home is not None:
        env["HOME"] = str(home)
    return env


def test_the_install_page_names_what_the_machine_unit_uses() -> None:
    """docs/install-machine.md and the unit agree: the venv, the configuration files,
    the working directory and the audit log the page tells an operator about are the
    ones the unit runs with."""
    unit = (DEPLOY / "cmdop-machine@.service").read_text()
    page = (repo_root() / "docs" / "install-machine.md").read_text()
    settings = dict(re.findall(r"(?m)^(\w+)=(.*)$", unit))
    assert settings["ExecStart"] == f"{INSTALL_PREFIX}/bin/cmdop-worker worker --machine %i"
    assert settings["User"] == "cmdop" and "useradd" in page and " cmdop\n" in page
    named = [
        f"python3 -m venv {INSTALL_PREFIX}",
        f"{INSTALL_PREFIX}/bin/pip install",
        "/etc/cmdop-worker/env",
        "/etc/cmdop-worker/policy.toml",
        settings["WorkingDirectory"].replace("%i", "NAME"),
        "/var/log/cmdop-worker/NAME/audit.jsonl",
    ]
    assert [n for n in named if n not in page] == []
    assert "EnvironmentFile=/etc/cmdop-worker/env" in unit
    assert "Environment=CMDOP_POLICY_FILE=/etc/cmdop-worker/policy.toml" in unit
    assert "Environment=CMDOP_AUDIT_LOG=/var/log/cmdop-worker/%i/audit.jsonl" in unit


# What stops unprivileged bwrap when systemd sets it, or the per-call cgroups
# (ProtectControlGroups), or JITs in tools (MemoryDenyWriteExecute):
# deploy/systemd/cmdop-machine@.service says why for each. The machine unit sets none.
_BREAKS_BWRAP = (
    "RestrictNamespaces",
    "PrivateUsers",
    "ProtectKernelTunables",
    "ProtectKernelLogs",
    "ProcSubset",
    "ProtectControlGroups",
    "MemoryDenyWriteExecute",
)


def test_the_machine_unit_sets_nothing_that_stops_its_sandbox() -> None:
    unit = (DEPLOY / "cmdop-machine@.service").read_text()
    keys = re.findall(r"(?m)^(\w+)=", unit)
    assert [key for key in keys if key in _BREAKS_BWRAP] == []
    # bwrap mounts: @system-service alone refuses mount(), umount2() and pivot_root().
    (calls,) = re.findall(r"(?m)^SystemCallFilter=(.*)$", unit)
    assert "@mount" in calls.split()
    assert "AF_NETLINK" in re.findall(r"(?m)^RestrictAddressFamilies=(.*)$", unit)[0].split()
    assert "Delegate=yes" in unit.splitlines()
