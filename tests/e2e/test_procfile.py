"""The Procfile: every process it names can start, Flower is behind auth, and
`honcho start` brings up a fleet that `cmdop-worker machines` sees, then stops cleanly."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cmdop_worker.surfaces.cli import build_parser
from cmdop_worker.surfaces.fleet import free_port
from tests.conftest import repo_root

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def procfile() -> dict[str, str]:
    entries = {}
    for line in (repo_root() / "Procfile").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, command = line.split(":", 1)
            entries[name.strip()] = command.strip()
    return entries


def program_and_args(command: str) -> list[str]:
    """The command's words after `env` and any VAR=value assignments."""
    words = shlex.split(command)
    while words and (words[0] == "env" or ASSIGNMENT.match(words[0])):
        words.pop(0)
    return words


def test_the_procfile_names_redis_a_coordinator_two_machines_and_flower() -> None:
    entries = procfile()
    assert set(entries) == {"redis", "coordinator", "alpha", "beta", "flower"}
    assert program_and_args(entries["redis"])[:2] == ["redis-server", "--port"]
    assert program_and_args(entries["alpha"])[-2:] == ["--machine", "alpha"]
    assert program_and_args(entries["beta"])[-2:] == ["--machine", "beta"]


def test_every_program_exists_and_every_cmdop_worker_command_parses() -> None:
    path = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    for name, command in procfile().items():
        words = program_and_args(command)
        assert shutil.which(words[0], path=path), f"{name}: no {words[0]} on PATH"
        if words[0] == "cmdop-worker":
            build_parser().parse_args(words[1:])


def test_flower_requires_basic_auth() -> None:
    flower = procfile()["flower"]
    assert "--basic-auth=" in flower
    assert "${FLOWER_USER:?" in flower and "${FLOWER_PASSWORD:?" in flower
    assert "--address=127.0.0.1" in flower


def test_honcho_start_brings_up_a_fleet_and_stops_it(tmp_path) -> None:
    redis_port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("CMDOP_", "FLOWER_"))},
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "REDIS_PORT": str(redis_port),
        "FLOWER_PORT": str(free_port()),
        "FLOWER_USER": "operator",
        "FLOWER_PASSWORD": "not-a-real-password",
    }
    argv = [str(BIN / "honcho"), "-f", str(repo_root() / "Procfile"), "-d", str(tmp_path), "start"]
    log = tmp_path / "honcho.log"
    with log.open("wb") as out:
        honcho = subprocess.Popen(
            argv,
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    query = {**env, "CMDOP_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    try:
        listing = _wait_for_machines(query, honcho)
        assert "alpha" in listing and "beta" in listing, listing
    finally:
        honcho.send_signal(signal.SIGTERM)
        try:
            honcho.wait(timeout=20)
        finally:
            leftover = _kill_leftovers(log.read_text(errors="replace"))
    assert leftover == [], f"still running after honcho stopped: {leftover}"


def _wait_for_machines(env: dict[str, str], honcho: subprocess.Popen[bytes]) -> str:
    give_up = time.monotonic() + 45
    listing = ""
    while time.monotonic() < give_up and honcho.poll() is None:
        listing = subprocess.run(
            [str(BIN / "cmdop-worker"), "machines"], env=env, capture_output=True, text=True
        ).stdout
        if "alpha" in listing and "beta" in listing:
            return listing
        time.sleep(0.5)
    return listing


def _kill_leftovers(log: str) -> list[int]:
    """Pids honcho started that are still alive (and are killed now, to clean up)."""
    alive = []
    for pid in map(int, re.findall(r"started \(pid=(\d+)\)", log)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
        os.killpg(pid, signal.SIGKILL)
    return alive
