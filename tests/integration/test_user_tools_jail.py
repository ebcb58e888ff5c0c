"""The operator's own Python tools (`@tool`) run in the call's sandbox, attacked through
real machine workers, a real passworded Redis and a real coordinator.

The tools are `jail_tools`, loaded by each machine through `CMDOP_TOOL_MODULES`. Two
machines in mode bypass, writable only under `<markers>/granted`, with the worker's
environment holding an API key and the Redis URL's password:

- `jailed`: the sandbox on; its network a list naming a local web server by address,
  and the fleet's Redis port (refused all the same).
- `as-nobody`: as `jailed`, its tools run as the user `nobody` (`CMDOP_TOOL_USER`).
- `control`: `CMDOP_SANDBOX=off`: the very same attempts run inside the worker there,
  and every one of them succeeds, so each attempt in the sandbox could have.

Markers live under /var/tmp: the sandbox's private /tmp could not hide a write there.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.procs import gone_within, servers_of, wait_for

from ..conftest import isolated_env, run_tool_calls
from ..net import page_handler

pytestmark = pytest.mark.integration

API_KEY = f"sk-ant-jail-{uuid.uuid4().hex}"
REDIS_PASSWORD = f"pw-{uuid.uuid4().hex}"
PAGE = f"page-{uuid.uuid4().hex}"
MODULES = '["tests.integration.jail_tools"]'
REPO = Path(__file__).resolve().parents[2]
TOOL_USER = "nobody"


@dataclass
class Fleet:
    client: Client
    fake: FakeAnthropic
    fleet: LocalFleet
    redis: RedisServer
    web_port: int
    markers: Path  # nothing writable here
    granted: Path  # the sandbox's writable path

    def calls(self, machine: str, uses: list[tuple[str, dict[str, Any]]]) -> list[Event]:
        """One run making every call at once; the TOOL_ENDs in call order."""
        blocks = [{"name": tool, "input": tool_input} for tool, tool_input in uses]
        return run_tool_calls(self.client, self.fake, machine, blocks)

    def both(self, tool: str, args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The call's TOOL_END data on `jailed`, then on `control`."""
        (jailed,) = self.calls("jailed", [(tool, args)])
        (control,) = self.calls("control", [(tool, args)])
        return jailed.data, control.data


@pytest.fixture(scope="module")
def box(fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    markers = Path(f"/var/tmp/cmdop-user-jail-{uuid.uuid4().hex[:8]}")
    granted = markers / "granted"
    granted.mkdir(parents=True)
    web = ThreadingHTTPServer(("127.0.0.1", 0), page_handler(PAGE))
    threading.Thread(target=web.serve_forever, daemon=True).start()
    server = RedisServer(password=REDIS_PASSWORD).start()
    allowed = [f"127.0.0.1:{web.server_port}", f"127.0.0.1:{server.port}"]
    policy = markers / "policy.toml"
    policy.write_text(
        f'mode = "bypass"\n[sandbox]\nwritable = ["{granted}"]\nnetwork = {json.dumps(allowed)}\n'
    )
    # Whole outputs in the events: the control's must show all the probe found.
    env = isolated_env(
        server.url, fake_model, worker_concurrency="4", event_output_max_chars="1000000"
    )
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("user-jail-logs"))
    machine = {
        "CMDOP_POLICY_FILE": str(policy),
        "CMDOP_TOOL_MODULES": MODULES,
        "PYTHONPATH": str(REPO),
        "ANTHROPIC_API_KEY": API_KEY,
    }
    try:
        fleet.start_coordinator()
        fleet.start_machine("jailed", machine)
        fleet.start_machine("control", {**machine, "CMDOP_SANDBOX": "off"})
        fleet.start_machine("as-nobody", {**machine, "CMDOP_TOOL_USER": TOOL_USER})
        fleet.wait_ready(["jailed", "control", "as-nobody"], timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield Fleet(client, fake_model, fleet, server, web.server_port, markers, granted)
    finally:
        fleet.stop()
        server.stop()
        web.shutdown()
        web.server_close()
        shutil.rmtree(markers, ignore_errors=True)


def tool_servers_under(ancestor: int) -> list[int]:
    """Host pids of the tool servers a worker started (bwrap and the bridge between)."""
    return servers_of(ancestor, b"cmdop_worker.machine.toolserve")


def test_a_tool_server_is_ready_before_the_first_call(box: Fleet) -> None:
    # First in this file: no test has called a tool on `as-nobody` yet.
    worker = box.fleet.workers["as-nobody"].pid
    assert wait_for(lambda: tool_servers_under(worker), 20, "a tool server started at start")


def test_a_user_tool_writes_only_where_touch_could(box: Fleet) -> None:
    outside = box.markers / f"by-user-tool-{uuid.uuid4().hex[:6]}"
    inside = box.granted / "by-user-tool"
    out, into = box.calls(
        "jailed",
        [
            ("jail_write", {"path": str(outside), "content": "owned"}),
            ("jail_write", {"path": str(inside), "content": "fine"}),
        ],
    )
    assert out.data["status"] == "error", out.data
    assert "Read-only file system" in out.data["output"]
    assert not outside.exists()
    assert into.data["status"] == "ok" and inside.read_text() == "fine"
    (control,) = box.calls("control", [("jail_write", {"path": str(outside), "content": "x"})])
    assert control.data["status"] == "ok" and outside.read_text() == "x"  # the probe works
    outside.unlink()


def test_a_user_tool_reads_none_of_the_workers_secrets(box: Fleet) -> None:
    jailed, control = box.both("jail_environ", {})
    assert jailed["status"] == "ok", jailed
    seen = json.loads(jailed["output"])
    assert "HOME" in seen and "CMDOP_REDIS_URL" not in seen  # the tool environment only
    for secret in (API_KEY, REDIS_PASSWORD):
        assert secret not in jailed["output"]
        assert secret in control["output"]  # in the worker: /proc/self/environ


def test_a_user_tool_sees_the_sandboxs_tmp_not_the_hosts(box: Fleet) -> None:
    secret = f"host-tmp-{uuid.uuid4().hex}"
    host_file = Path("/tmp") / f"cmdop-user-jail-{uuid.uuid4().hex[:8]}"
    host_file.write_text(secret)
    try:
        jailed, control = box.both("jail_read", {"path": str(host_file)})
    finally:
        host_file.unlink()
    assert jailed["status"] == "error" and "No such file" in jailed["output"], jailed
    assert secret not in jailed["output"]
    assert control["output"] == secret


def test_a_user_tool_cannot_reach_the_fleets_redis(box: Fleet) -> None:
    redis_at = {"host": "127.0.0.1", "port": box.redis.port}
    jailed, control = box.both("jail_connect", redis_at)
    assert jailed["status"] == "error" and "Connection refused" in jailed["output"], jailed
    assert control["output"].startswith("-NOAUTH"), control  # Redis answered the worker
    through_proxy, page = box.calls(
        "jailed",
        [
            ("jail_fetch", {"url": f"http://127.0.0.1:{box.redis.port}/"}),
            ("jail_fetch", {"url": f"http://127.0.0.1:{box.web_port}/"}),
        ],
    )
    assert through_proxy.data["status"] == "error", through_proxy.data
    assert "NOAUTH" not in through_proxy.data["output"]
    assert page.data == {**page.data, "status": "ok", "output": PAGE}  # the call's network


def test_replies_statuses_and_errors_read_as_in_the_worker(box: Fleet) -> None:
    uses = [
        ("jail_reply", {"output": "took too long", "status": "timeout"}),
        ("jail_reply", {"output": "fine", "status": "ok"}),
        ("jail_fail", {}),
        ("jail_pid", {"unexpected": 1}),
        ("jail_big", {"chars": 200_000}),
    ]
    jailed = [e.data for e in box.calls("jailed", uses)]
    control = [e.data for e in box.calls("control", uses)]
    assert [(d["status"], d["output"]) for d in jailed[:2]] == [
        ("timeout", "took too long"),
        ("ok", "fine"),
    ]
    assert jailed[2]["output"] == "ValueError: broken on jailed", jailed[2]
    assert control[2]["output"] == "ValueError: broken on control"
    assert jailed[3]["status"] == "invalid"
    assert jailed[3]["output"] == control[3]["output"]
    assert "\n[output truncated: " in jailed[4]["output"]
    assert jailed[4]["output"] == control[4]["output"]  # cut the same way
    assert [d["status"] for d in jailed] == [d["status"] for d in control]


def test_an_unsandboxed_tool_runs_in_the_worker_and_is_named(box: Fleet) -> None:
    worker = box.fleet.workers["jailed"].pid
    in_worker, in_jail = box.calls("jailed", [("worker_pid", {}), ("jail_pid", {})])
    assert in_worker.data["output"] == str(worker)
    assert in_jail.data["status"] == "ok" and in_jail.data["output"] != str(worker)
    assert int(in_jail.data["output"]) < 10  # its own PID namespace
    log = box.fleet.workers["jailed"].log_path.read_text(errors="replace")
    assert "tool worker_pid is registered with sandbox=False" in log
    assert "tool jail_pid is registered" not in log
    presence = json.loads(box.client.redis.get(box.client.keys.machine("jailed")))
    assert presence["sandbox"] == "bwrap; unsandboxed: worker_pid"


def host_pids_of(argv: list[bytes]) -> list[int]:
    """Host pids of the processes running exactly `argv`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry / "cmdline").read_bytes().split(b"\0")[:-1] == argv:
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def test_a_ui_cancel_kills_a_busy_tool_server_and_its_processes(box: Fleet) -> None:
    seconds = 3000 + uuid.uuid4().int % 1000  # tells its `sleep` from any other
    name = f"slow{uuid.uuid4().hex[:8]}"
    sleep = {"type": "tool_use", "name": "jail_sleep", "input": {"seconds": seconds}}
    box.fake.add_script(name, [[sleep], [{"type": "text", "text": "done"}]])
    run = box.client.submit(prompt=f"[[script:{name}]] go", machine="jailed", timeout_s=120)
    for event in run.events():
        if event.type == "TOOL_START":
            break
    argv = [b"sleep", str(seconds).encode()]
    (child,) = wait_for(lambda: host_pids_of(argv), 20, "the tool's sleep")
    assert run.cancel(ui=True, reason="stop the sleep")
    ends = [e for e in run.events(idle_timeout_s=10) if e.type == "TOOL_END"]
    assert [e.data["status"] for e in ends] == ["cancelled"], ends
    assert gone_within(child, 5), "the tool's process survived a ui cancel"
    (after,) = box.calls("jailed", [("jail_pid", {})])
    assert after.data["status"] == "ok"


@pytest.mark.skipif(os.geteuid() != 0, reason="a tool user needs a root worker")
def test_a_user_tool_runs_as_the_tool_user_with_the_calls_network(box: Fleet) -> None:
    scratch = f"/tmp/scratch-{uuid.uuid4().hex[:6]}"
    ids, page, scratch_file = box.calls(
        "as-nobody",
        [
            ("jail_ids", {}),
            ("jail_fetch", {"url": f"http://127.0.0.1:{box.web_port}/"}),
            ("jail_write", {"path": scratch, "content": "temp"}),
        ],
    )
    (root,) = box.calls("control", [("jail_ids", {})])
    uid = pwd.getpwnam(TOOL_USER).pw_uid
    assert ids.data["output"] == f"{uid} {uid} PermissionError", ids.data
    assert root.data["output"] == "0 0 read /etc/shadow"  # the worker's own rights
    assert page.data["status"] == "ok" and page.data["output"] == PAGE, page.data
    assert scratch_file.data["status"] == "ok", scratch_file.data  # its private /tmp
    assert not Path(scratch).exists()
