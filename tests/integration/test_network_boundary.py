"""A tool never reaches the fleet's Redis, whatever network the policy gives it.

Real machine workers, a real Redis, a real coordinator. The Redis is the documented
quick set-up at its worst: no password (`CMDOP_ALLOW_OPEN_REDIS=1`), listening on
every address of this host. Each attempt sends `SET <key> 1`; the keys must never
appear. A control runs the very same attempts outside the sandbox first: there they
all set their keys, so every attempt in the sandbox could have succeeded.

Three machines, each in mode bypass (only the sandbox stands):

- `cut`: no policy file: network "none".
- `open`: `network = true`, the legacy word for "any".
- `listed`: a list naming a local web server by address, and the fleet's own Redis
  port, which is refused all the same.
- `as-nobody`: the same list, tools run as `nobody` (`CMDOP_TOOL_USER`).

The web server is a canary too: it counts every connection it accepts.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

import pytest
import redis

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import isolated_env, run_tool_calls
from ..net import page_handler

pytestmark = pytest.mark.integration

PYTHON = os.path.realpath(sys.executable)  # visible in the sandbox; the venv is not needed
MARKER = f"canary-{uuid.uuid4().hex}"


def resolvable(name: str) -> list[str]:
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return []
    return [name]


# Spellings of this machine's loopback, or of "this machine", that a resolver or a
# client turns into an address of it; the host's own name too, where it resolves.
LOOPBACK_FORMS = ["127.0.0.1", "localhost", "::1", "0.0.0.0", "0", "127.1"]
LOOPBACK_FORMS += resolvable(socket.gethostname())
NUMERIC_FORMS = ["2130706433", "0x7f000001", "017700000001"]

ATTACK = r"""
import json, socket, struct, sys
targets, prefix = json.loads(sys.argv[1]), sys.argv[2]
PROXY = ("127.0.0.1", 3128)

def bracket(host):
    return f"[{host}]" if ":" in host else host

def direct(host, port, key):
    with socket.create_connection((host, port), 3) as s:
        s.sendall(f"SET {key} 1\r\n".encode())
        return s.recv(64)

def connect(host, port, key):
    with socket.create_connection(PROXY, 3) as s:
        where = f"{bracket(host)}:{port}"
        s.sendall(f"CONNECT {where} HTTP/1.1\r\nHost: {where}\r\n\r\n".encode())
        head = s.recv(4096)
        if head.startswith(b"HTTP/1.1 200"):
            s.sendall(f"SET {key} 1\r\n".encode())
            return head + s.recv(64)
        return head.split(b"\r\n")[0]

def socks(host, port, key):
    with socket.create_connection(PROXY, 3) as s:
        s.sendall(b"\x05\x01\x00")
        s.recv(2)
        name = host.encode()
        s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port))
        reply = s.recv(10)
        if reply[1:2] == b"\x00":
            s.sendall(f"SET {key} 1\r\n".encode())
            return b"granted " + s.recv(64)
        return b"socks reply %d" % reply[1]

for host, port in targets:
    for method in (direct, connect, socks):
        key = f"{prefix}:{method.__name__}:{host}"
        try:
            got = method(host, port, key)
        except OSError as exc:
            got = f"error {exc}".encode()
        print(json.dumps([host, method.__name__, got.decode(errors="replace")]))
"""


def attack_command(targets: list[str], port: int, prefix: str) -> str:
    """bash's /dev/tcp, redis-cli, then Python: direct, HTTP CONNECT and SOCKS5."""
    shell = [
        f"(printf 'SET {prefix}:bash:{host} 1\\r\\n' > /dev/tcp/{host}/{port}) 2>/dev/null"
        for host in targets
    ]
    if shutil.which("redis-cli"):
        shell += [f"redis-cli -h {host} -p {port} SET {prefix}:cli:{host} 1" for host in targets]
    pairs = json.dumps([[host, port] for host in targets])
    script = f"{PYTHON} - '{pairs}' {prefix} <<'EOF'\n{ATTACK}\nEOF"
    return "; ".join(shell) + "\n" + script


def host_addresses() -> list[str]:
    """Every address of this host but loopback and link-local (`ip -o addr`, then the
    resolver's view of the host name)."""
    found: list[str] = []
    if shutil.which("ip"):
        out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        found += [line.split()[3].split("/")[0] for line in out.splitlines()]
    found += [str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)]
    return sorted(
        {a for a in found if not a.startswith(("127.", "fe80")) and a not in ("::1", "0.0.0.0")}
    )


class Canary(ThreadingHTTPServer):
    """A local web server on every address that counts the connections it accepts."""

    address_family = socket.AF_INET6
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("::", 0), page_handler(MARKER))
        self.accepted = 0

    def get_request(self) -> tuple[socket.socket, Any]:
        self.accepted += 1
        return super().get_request()

    @property
    def port(self) -> int:
        return int(self.server_address[1])


@dataclass
class Boundary:
    client: Client
    fake: FakeAnthropic
    redis: redis.Redis
    redis_port: int
    canary: Canary
    targets: list[str]

    def run(self, machine: str, command: str) -> str:
        uses = [{"name": "execute_command", "input": {"command": command}}]
        (end,) = run_tool_calls(self.client, self.fake, machine, uses)
        assert end.data["status"] in ("ok", "error"), end.data
        return str(end.data["output"])

    def forged(self, prefix: str) -> list[str]:
        return sorted(k.decode() for k in self.redis.keys(f"{prefix}:*"))


@pytest.fixture(scope="module")
def boundary(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Boundary]:
    work = tmp_path_factory.mktemp("boundary")
    server = RedisServer(extra_args=["--bind", "0.0.0.0", "::", "--protected-mode", "no"])
    server.start()
    canary = Canary()
    threading.Thread(target=canary.serve_forever, daemon=True).start()
    listed = work / "listed.toml"
    # A bare address admits every port on it but the fleet's.
    allowed = ["127.0.0.1", f"127.0.0.1:{canary.port}", f"127.0.0.1:{server.port}"]
    allowed += [f"{host}:{server.port}" for host in host_addresses() if ":" not in host]
    listed.write_text(f"[sandbox]\nnetwork = {json.dumps(allowed)}\n")
    opened = work / "open.toml"
    opened.write_text("[sandbox]\nnetwork = true\n")
    env = {
        **isolated_env(server.url, fake_model, permission_mode="bypass"),
        "CMDOP_ALLOW_OPEN_REDIS": "1",
    }
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("boundary-logs"))
    try:
        fleet.start_coordinator()
        fleet.start_machine("cut", {})
        fleet.start_machine("open", {"CMDOP_POLICY_FILE": str(opened)})
        fleet.start_machine("listed", {"CMDOP_POLICY_FILE": str(listed)})
        nobody = {"CMDOP_POLICY_FILE": str(listed), "CMDOP_TOOL_USER": "nobody"}
        fleet.start_machine("as-nobody", nobody)
        fleet.wait_ready(["cut", "open", "listed", "as-nobody"], timeout_s=60)
        targets = [*LOOPBACK_FORMS, *NUMERIC_FORMS, *host_addresses()]
        with Client(Settings(redis_url=server.url)) as client:
            store = redis.Redis.from_url(server.url)
            yield Boundary(client, fake_model, store, server.port, canary, targets)
            store.close()
    finally:
        fleet.stop()
        canary.shutdown()
        canary.server_close()
        server.close()


def attempts(output: str) -> list[list[str]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith('["')]


def test_the_attempts_reach_redis_from_outside_the_sandbox(boundary: Boundary) -> None:
    """The control: every target, by every direct method, sets its key from the host."""
    prefix = f"control{uuid.uuid4().hex[:6]}"
    command = attack_command(boundary.targets, boundary.redis_port, prefix)
    subprocess.run(["bash", "-c", command], capture_output=True, timeout=120)
    methods = ["bash", "direct", *(["cli"] if shutil.which("redis-cli") else [])]
    expected = sorted(f"{prefix}:{m}:{host}" for m in methods for host in boundary.targets)
    assert boundary.forged(prefix) == expected
    assert any(":" in host for host in boundary.targets)  # IPv6 too, not loopback only


@pytest.mark.parametrize("machine", ["cut", "open", "listed"])
def test_no_tool_reaches_the_fleets_redis(boundary: Boundary, machine: str) -> None:
    prefix = f"forged{uuid.uuid4().hex[:6]}"
    accepted = boundary.canary.accepted
    output = boundary.run(machine, attack_command(boundary.targets, boundary.redis_port, prefix))
    assert boundary.forged(prefix) == []
    tried = attempts(output)
    assert len(tried) == 3 * len(boundary.targets), output
    through_proxy = [got for _, method, got in tried if method != "direct"]
    if machine == "cut":  # no proxy at all: nothing listens in the namespace
        assert all(got.startswith("error") for got in through_proxy), through_proxy
    else:  # the proxy answered, and refused
        refused = ("HTTP/1.1 403", "socks reply 2")
        assert all(got.startswith(refused) for got in through_proxy), through_proxy
    assert all(got.startswith("error") for _, method, got in tried if method == "direct")
    assert boundary.canary.accepted == accepted


def test_a_listed_fleet_port_is_refused_with_its_reason(boundary: Boundary) -> None:
    output = boundary.run("listed", f"curl -sS http://127.0.0.1:{boundary.redis_port}/")
    assert "fleet's own Redis" in output, output


WRAPPED_PORT_PROBE = """
import json, socket, sys
port, prefix = int(sys.argv[1]), sys.argv[2]
heads = [f"CONNECT 127.0.0.1:{port + k * 65536} HTTP/1.1" for k in (1, 2)]
heads += [f"GET http://127.0.0.1:{port + 65536}/ HTTP/1.1", f"CONNECT 127.0.0.1:0{port} HTTP/1.1"]
for head in heads:
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(head.encode() + b"\\r\\nHost: x\\r\\n\\r\\n")
    answer = s.recv(200).decode(errors="replace").splitlines()[0]
    if answer.startswith("HTTP/1.1 200"):
        s.sendall(f"SET {prefix}:{len(head)} 1\\r\\n".encode())
    print(json.dumps([head, answer]))
    s.close()
"""


def test_a_port_past_65535_does_not_wrap_around_to_the_fleets(boundary: Boundary) -> None:
    """6379 + 65536 is 6379 to the socket layer: the proxy must refuse it, not wrap it."""
    prefix = f"wrapped{uuid.uuid4().hex[:6]}"
    probe = f"python3 -c {shlex.quote(WRAPPED_PORT_PROBE)} {boundary.redis_port} {prefix}"
    output = boundary.run("listed", probe)
    answers = [json.loads(line) for line in output.splitlines() if line.startswith('["')]
    assert len(answers) == 4, output
    assert all(" 400 " in answer or " 403 " in answer for _, answer in answers), answers
    assert boundary.forged(prefix) == []


def test_a_listed_local_service_is_reached_through_the_proxy(boundary: Boundary) -> None:
    accepted = boundary.canary.accepted
    output = boundary.run("listed", f"curl -sS http://127.0.0.1:{boundary.canary.port}/page")
    assert MARKER in output, output
    assert boundary.canary.accepted == accepted + 1
    https = boundary.run("listed", f"curl -sS -p http://127.0.0.1:{boundary.canary.port}/page")
    assert MARKER in https, https  # the same through a CONNECT tunnel


def test_a_tool_run_as_another_user_has_the_same_network(boundary: Boundary) -> None:
    """The bridge must start for a user who cannot reach the worker's interpreter."""
    prefix = f"nobody{uuid.uuid4().hex[:6]}"
    port = boundary.redis_port
    attacks = "; ".join(
        f"(printf 'SET {prefix}:{host} 1\\r\\n' > /dev/tcp/{host}/{port}) 2>/dev/null"
        for host in boundary.targets
    )
    page = f"curl -sS http://127.0.0.1:{boundary.canary.port}/page"
    output = boundary.run("as-nobody", f"id -u; {attacks}; {page}")
    assert MARKER in output and "65534" in output, output
    assert boundary.forged(prefix) == []


def test_any_refuses_this_machine_and_says_why(boundary: Boundary) -> None:
    accepted = boundary.canary.accepted
    forms = [*LOOPBACK_FORMS, *NUMERIC_FORMS, *host_addresses()]
    urls = " ".join(f"http://{f'[{h}]' if ':' in h else h}:{boundary.canary.port}/" for h in forms)
    output = boundary.run("open", f"for u in {urls}; do curl -sS $u; echo; done")
    refusals = [line for line in output.splitlines() if line.startswith("cmdop egress:")]
    assert len(refusals) == len(forms), output
    assert MARKER not in output
    assert boundary.canary.accepted == accepted


def test_tools_get_the_proxy_only_when_they_have_network(boundary: Boundary) -> None:
    cut = boundary.run("cut", "env | grep -ci proxy; curl -sS -m 5 http://127.0.0.1:1/")
    assert "HTTP_PROXY" not in cut
    opened = boundary.run("open", "env | grep -i _proxy= | sort")
    assert "HTTPS_PROXY=http://127.0.0.1:3128" in opened, opened
