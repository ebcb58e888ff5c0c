"""The Procfile: every process it names can start, Flower is behind auth on loopback,
the gateway on loopback, and `.venv/bin/honcho start` in a clone (venv not activated,
secrets in `.env`) brings up a fleet that `cmdop-worker machines` and the gateway see,
then stops cleanly."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from cmdop_worker.state.keys import Keys
from cmdop_worker.surfaces.cli import build_parser
from cmdop_worker.surfaces.fleet import free_port
from tests.conftest import repo_root
from tests.net import connects, http_status, listening_addresses, own_public_address
from tests.procs import wait_for

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
DEFAULTED = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}")


def procfile() -> dict[str, str]:
    entries = {}
    for line in (repo_root() / "Procfile").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, command = line.split(":", 1)
            entries[name.strip()] = command.strip()
    return entries


def program_and_args(command: str) -> list[str]:
    """The command's words after `env` and any VAR=value assignments, each `${VAR:-x}`
    read as its default `x` (what the shell makes of it with VAR unset)."""
    words = shlex.split(DEFAULTED.sub(r"\1", command))
    while words and (words[0] == "env" or ASSIGNMENT.match(words[0])):
        words.pop(0)
    return words


def test_the_procfile_names_redis_a_coordinator_two_machines_flower_and_the_gateway() -> None:
    entries = procfile()
    assert set(entries) == {"redis", "coordinator", "alpha", "beta", "flower", "gateway"}
    assert program_and_args(entries["gateway"]) == [
        "cmdop-worker", "gateway", "--host", "127.0.0.1", "--port", "8080",
    ]  # fmt: skip
    assert program_and_args(entries["redis"])[:2] == ["sh", "-c"]
    assert "| redis-server - --port" in entries["redis"]
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


def test_flower_without_credentials_stops_with_a_message_that_says_what_to_do(tmp_path) -> None:
    env = {**_system_env(), "FLOWER_PORT": str(free_port())}
    done = subprocess.run(
        [str(BIN / "honcho"), "-f", str(repo_root() / "Procfile"), "start", "flower"],
        env=env,
        cwd=_clone(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "FLOWER_USER: is not set: copy .env.example to .env" in done.stdout, done.stdout
    example = (repo_root() / ".env.example").read_text()
    assert "FLOWER_USER=" in example and "FLOWER_PASSWORD=" in example


def test_redis_requires_a_password_given_on_stdin_and_every_url_carries_it() -> None:
    entries = procfile()
    redis_entry = entries["redis"]
    assert redis_entry.startswith("""sh -c ': "${REDIS_PASSWORD:?""")
    # On standard input, never in argv, where `ps` shows it.
    assert 'echo "requirepass $REDIS_PASSWORD" | redis-server - ' in redis_entry
    for name in ("coordinator", "alpha", "beta", "flower", "gateway"):
        assert "redis://:${REDIS_PASSWORD}@127.0.0.1:" in entries[name], name
    assert "\nREDIS_PASSWORD=\n" in (repo_root() / ".env.example").read_text()


def test_redis_without_a_password_stops_with_a_message_that_says_what_to_do(tmp_path) -> None:
    env = {**_system_env(), "REDIS_PORT": str(free_port())}
    done = subprocess.run(
        [str(BIN / "honcho"), "-f", str(repo_root() / "Procfile"), "start", "redis"],
        env=env,
        cwd=_clone(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "REDIS_PASSWORD: is not set: copy .env.example to .env" in done.stdout, done.stdout


def test_dot_env_holds_secrets_and_is_git_ignored() -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=repo_root())
    assert ignored.returncode == 0, ".env is not git-ignored"
    example = subprocess.run(["git", "check-ignore", "-q", ".env.example"], cwd=repo_root())
    assert example.returncode == 1, ".env.example must not be ignored"


def test_honcho_start_from_a_clone_without_the_venv_activated(tmp_path) -> None:
    """`.venv/bin/honcho start` in a clone, settings in `.env`, no venv on PATH: the
    fleet comes up, Flower listens on loopback only behind auth, and all of it stops
    cleanly (no traceback from a worker whose Redis went first)."""
    clone = _clone(tmp_path)
    redis_port, flower_port, gateway_port = free_port(), free_port(), free_port()
    settings = {"REDIS_PORT": redis_port, "FLOWER_PORT": flower_port, "GATEWAY_PORT": gateway_port}
    settings |= {"FLOWER_USER": "operator", "FLOWER_PASSWORD": "not-a-real-password"}
    settings |= {"REDIS_PASSWORD": "redis-pw-for-this-test"}
    (clone / ".env").write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    log = tmp_path / "honcho.log"
    honcho = _start_honcho(clone, log)
    url = f"redis://:redis-pw-for-this-test@127.0.0.1:{redis_port}/0"
    query = {**_system_env(), "CMDOP_REDIS_URL": url}
    try:
        listing = _wait_for_machines(query, honcho)
        assert "alpha" in listing and "beta" in listing, log.read_text()
        _assert_flower_on_loopback_behind_auth(flower_port)
        _assert_gateway_on_loopback_sees_the_fleet(gateway_port)
    finally:
        honcho.send_signal(signal.SIGTERM)
        try:
            honcho.wait(timeout=20)
        finally:
            leftover = _kill_leftovers(log.read_text(errors="replace"))
    assert leftover == [], f"still running after honcho stopped: {leftover}"
    output = log.read_text(errors="replace")
    assert "Traceback" not in output, output[-6000:]


def _system_env() -> dict[str, str]:
    """This environment with the virtualenv deactivated and no CMDOP_/FLOWER_ settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CMDOP_", "FLOWER_"))}
    env.pop("VIRTUAL_ENV", None)
    venv = {str(BIN), os.environ.get("VIRTUAL_ENV", str(BIN)) + "/bin"}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p not in venv)
    return env


def _clone(tmp_path: Path) -> Path:
    """A checkout's layout for honcho: a directory whose `.venv` is this virtualenv."""
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(BIN.parent)
    return clone


def _start_honcho(clone: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = [str(BIN / "honcho"), "-f", str(repo_root() / "Procfile"), "start"]
    with log.open("wb") as out:
        return subprocess.Popen(
            argv,
            env=_system_env(),
            cwd=clone,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _assert_flower_on_loopback_behind_auth(port: int) -> None:
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{url}/healthcheck") == 200, 30, "flower's healthcheck")
    assert {str(a) for a in listening_addresses(port)} == {"127.0.0.1"}
    public = own_public_address()
    if public is not None:
        assert not connects(public, port), f"flower answers on {public}"
    assert http_status(f"{url}/api/workers") == 401
    assert http_status(f"{url}/api/workers", "operator:not-a-real-password") == 200
    assert http_status(f"{url}/metrics") == 200  # Flower 2.2: no auth on /metrics (documented)


def _assert_gateway_on_loopback_sees_the_fleet(port: int) -> None:
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{url}/healthz") == 200, 30, "the gateway's /healthz")
    assert {str(a) for a in listening_addresses(port)} == {"127.0.0.1"}
    public = own_public_address()
    if public is not None:
        assert not connects(public, port), f"the gateway answers on {public}"
    with urllib.request.urlopen(f"{url}/v1/machines", timeout=10) as response:
        machines = {m["machine"] for m in json.loads(response.read())}
    assert {"alpha", "beta"} <= machines


def _wait_for_machines(env: dict[str, str], honcho: subprocess.Popen[bytes]) -> str:
    """`cmdop-worker machines` once it lists alpha and beta and a coordinator is up
    (its watchdog's presence key: stopping it before then would test nothing)."""
    give_up = time.monotonic() + 45
    listing = ""
    while time.monotonic() < give_up and honcho.poll() is None:
        listing = subprocess.run(
            [str(BIN / "cmdop-worker"), "machines"], env=env, capture_output=True, text=True
        ).stdout
        if "alpha" in listing and "beta" in listing and _coordinator_up(env):
            return listing
        time.sleep(0.5)
    return listing


def _coordinator_up(env: dict[str, str]) -> bool:
    client = redis.Redis.from_url(env["CMDOP_REDIS_URL"])
    try:
        return any(True for _ in client.scan_iter(match=Keys().coordinator_pattern))
    except redis.RedisError:
        return False
    finally:
        client.close()


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
