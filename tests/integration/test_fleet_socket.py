"""A tool cannot reach the fleet's Redis through a unix socket on disk.

A real redis-server listening ONLY on a unix socket, in a directory under /var/tmp
(neither /tmp nor /run, which the sandbox makes private anyway), and the whole fleet
on it: `CMDOP_REDIS_URL=unix:///…/redis.sock` (Celery gets `redis+socket://`). Tools
run with no network, but a socket on disk is reached by its path, not by the network.

Machines in mode bypass (the gate lets every call through; only the sandbox
stands): `apart`, whose grants do not touch the socket's directory (the directory is
hidden), `inside`, granted that very directory writable (the socket alone is
hidden), and `wide`, granted `/` writable (the host's /tmp and /run are not private
then). Each attempt would `SET` a key of its own; none may appear. A control runs
the same attempts outside the sandbox first: there they set their keys.

The other sockets a worker knows: a sibling machine worker's egress proxy, on this
same host, listens under the host's /tmp. `net` may reach a canary port through its
proxy; `wide` (no network of its own, the host's /tmp shown) must not borrow it.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, find_redis_server
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import isolated_env, run_tool_calls

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli"),
]

PYTHON = os.path.realpath(sys.executable)  # visible in the sandbox; the venv is not needed
CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(3)
try:
    s.connect(sys.argv[1])
    s.sendall(f"SET {sys.argv[2]} 1\\r\\n".encode())
    print("sent", s.recv(64))
except OSError as exc:
    print("error", exc)
"""


def attempts(sock: Path, prefix: str) -> str:
    """redis-cli on the socket, then Python's own connect."""
    cli = f"redis-cli -s {sock} SET {prefix}:cli 1 2>&1"
    script = f"{PYTHON} - {sock} {prefix}:python <<'EOF'\n{CONNECT}\nEOF"
    return f"{cli}; ls -la {sock.parent} 2>&1; {script}"


class Canary:
    """A TCP port on loopback that counts the connections it accepts."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


BORROW = """
import glob, socket, sys
for path in glob.glob("/tmp/cmdop-egress-*/egress.sock"):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(path)
        s.sendall(f"CONNECT 127.0.0.1:{sys.argv[1]} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n".encode())
        print(path, s.recv(200).split(b"\\r\\n")[0])
    except OSError as exc:
        print(path, "error", exc)
print("tried")
"""


def borrow(port: int) -> str:
    return f"{PYTHON} - {port} <<'EOF'\n{BORROW}\nEOF"


@dataclass
class SocketFleet:
    client: Client
    fake: FakeAnthropic
    sock: Path
    redis: redis.Redis
    canary: Canary


@pytest.fixture(scope="module")
def fleet(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SocketFleet]:
    base = Path(f"/var/tmp/cmdop-sock-{uuid.uuid4().hex[:8]}")
    where = base / "redis"
    where.mkdir(parents=True)
    sock = where / "redis.sock"
    server = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "777",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(where),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    canary = Canary()
    policies = {}
    for machine, writable in (("apart", base / "work"), ("inside", where), ("wide", Path("/"))):
        writable.mkdir(exist_ok=True)
        policies[machine] = base / f"{machine}.toml"
        policies[machine].write_text(f'mode = "bypass"\n[sandbox]\nwritable = ["{writable}"]\n')
    policies["net"] = base / "net.toml"
    allowed = f'["127.0.0.1:{canary.port}"]'
    policies["net"].write_text(f'mode = "bypass"\n[sandbox]\nnetwork = {allowed}\n')
    url = f"unix://{sock}"
    local = LocalFleet(isolated_env(url, fake_model), logdir=tmp_path_factory.mktemp("sock-logs"))
    try:
        host = redis.Redis(unix_socket_path=str(sock))
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.1)
        host.ping()
        local.start_coordinator()
        for machine, policy in policies.items():
            open_ok = {"CMDOP_ALLOW_OPEN_REDIS": "1"} if machine == "net" else {}
            local.start_machine(machine, {"CMDOP_POLICY_FILE": str(policy), **open_ok})
        local.wait_ready(list(policies), timeout_s=60)
        with Client(Settings(redis_url=url)) as client:
            yield SocketFleet(client, fake_model, sock, host, canary)
    finally:
        local.stop()
        server.terminate()
        server.wait(10)
        canary.listener.close()
        shutil.rmtree(base, ignore_errors=True)


def test_the_socket_is_reachable_outside_the_sandbox(fleet: SocketFleet) -> None:
    prefix = f"control-{uuid.uuid4().hex[:6]}"
    subprocess.run(["bash", "-c", attempts(fleet.sock, prefix)], capture_output=True, check=True)
    assert fleet.redis.get(f"{prefix}:cli") == b"1"
    assert fleet.redis.get(f"{prefix}:python") == b"1"


@pytest.mark.parametrize("machine", ["apart", "inside", "wide"])
def test_a_sandboxed_tool_cannot_reach_the_fleets_redis_socket(
    fleet: SocketFleet, machine: str
) -> None:
    prefix = f"{machine}-{uuid.uuid4().hex[:6]}"
    (end,) = run_tool_calls(
        fleet.client,
        fleet.fake,
        machine,
        [{"name": "execute_command", "input": {"command": attempts(fleet.sock, prefix)}}],
    )
    output = end.data["output"]
    assert fleet.redis.keys(f"{prefix}:*") == [], output
    assert "sent" not in output and "error" in output, output


def run_on(fleet: SocketFleet, machine: str, command: str) -> str:
    uses = [{"name": "execute_command", "input": {"command": command}}]
    (end,) = run_tool_calls(fleet.client, fleet.fake, machine, uses)
    return str(end.data["output"])


def test_a_tool_cannot_borrow_a_sibling_workers_egress_proxy(fleet: SocketFleet) -> None:
    run_on(fleet, "net", "true")  # its proxy starts with its first call
    proxies = glob.glob("/tmp/cmdop-egress-*/egress.sock")
    assert proxies, "the sibling's proxy socket is not under the host's /tmp"
    output = run_on(fleet, "wide", borrow(fleet.canary.port))
    assert "tried" in output and fleet.canary.accepted == 0, output
    subprocess.run([PYTHON, "-c", BORROW, str(fleet.canary.port)], check=True)  # control
    assert fleet.canary.accepted > 0
