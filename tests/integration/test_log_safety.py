"""A worker's log lines show what a tool chose as text, never as terminal controls.

Real workers, a real Redis. A tool in mode bypass with `network = true` asks the
machine's egress proxy for a host made of terminal controls (ESC, an OSC title, BEL,
the 8-bit CSI 0x9B, DEL); the proxy refuses it and logs the host. The model also
calls a tool whose name carries an ESC sequence. Every worker log is then read as
bytes: no ESC and no C1 CSI (UTF-8 `c2 9b`) may appear in it, and the refused host
must be there, shown as text: in the plain format on `plain`, as JSON escapes on `json`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import isolated_env, run_tool_calls

pytestmark = pytest.mark.integration

PYTHON = os.path.realpath(sys.executable)  # visible in the sandbox; the venv is not needed
HOST = b"evil\x1b]0;pwned\x07\x1b[2J\x9b31m\x7f.invalid"  # latin-1 on the wire
CONNECT = f"""
import socket
with socket.create_connection(("127.0.0.1", 3128), 5) as s:
    host = {HOST!r}
    s.sendall(b"CONNECT " + host + b":443 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    print(s.recv(4096).split(b"\\r\\n")[0].decode())
"""
SHOWN_PLAIN = "evil\u241b]0;pwned\u2407\u241b[2J<U+009B>31m\u2421.invalid"


@dataclass
class Logged:
    client: Client
    fake: FakeAnthropic
    fleet: LocalFleet


@pytest.fixture(scope="module")
def logged(fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logged]:
    policy = tmp_path_factory.mktemp("log-policy") / "policy.toml"
    policy.write_text('mode = "bypass"\n[sandbox]\nnetwork = true\n')
    server = RedisServer().start()
    env = isolated_env(server.url, fake_model, allow_open_redis="1")
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("log-safety"))
    try:
        fleet.start_coordinator()
        fleet.start_machine("plain", {"CMDOP_POLICY_FILE": str(policy)})
        fleet.start_machine("json", {"CMDOP_POLICY_FILE": str(policy), "CMDOP_LOG_JSON": "true"})
        fleet.wait_ready(["plain", "json"], timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield Logged(client, fake_model, fleet)
    finally:
        fleet.stop()
        server.stop()


def attack(logged: Logged, machine: str) -> bytes:
    """The refused CONNECT and a hostile tool name on `machine`; its log as bytes."""
    script = f"{PYTHON} - <<'EOF'\n{CONNECT}\nEOF"
    refused, unknown = run_tool_calls(
        logged.client,
        logged.fake,
        machine,
        [
            {"name": "execute_command", "input": {"command": script}},
            {"name": "read\x1b[2J\x9b1mfile", "input": {"path": "/etc/hostname"}},
        ],
    )
    assert "403" in refused.data["output"], refused.data  # the proxy did refuse it
    assert unknown.data["status"] != "ok", unknown.data
    return logged.fleet.workers[machine].log_path.read_bytes()


def assert_no_controls(data: bytes) -> None:
    assert b"\x1b" not in data and b"\xc2\x9b" not in data and b"\x07" not in data


def test_a_plain_log_line_shows_a_hostile_host_as_text(logged: Logged) -> None:
    data = attack(logged, "plain")
    assert f"egress refused {SHOWN_PLAIN}:443".encode() in data, data[-3000:]
    assert_no_controls(data)
    coordinator = logged.fleet.workers["coordinator"].log_path.read_bytes()
    assert_no_controls(coordinator)


def test_a_json_log_line_escapes_a_hostile_host(logged: Logged) -> None:
    data = attack(logged, "json")
    assert_no_controls(data)
    refusals = [
        json.loads(line)["message"]
        for line in data.decode().splitlines()
        if line.startswith("{") and "egress refused" in line
    ]
    assert refusals and refusals[-1].startswith(f"egress refused {HOST.decode('latin-1')}:443")
