"""The file tools run in the call's sandbox, attacked through real machine workers.

Two machines in mode bypass (the gate lets every call through, so only the sandbox
stands between a call and the host), writable only under `<markers>/granted`:
`box` takes every attempt; `slow` serves only the cancel test, so the one file server
it has started is the one a ui cancel must kill; `as-nobody` runs its tools as the
user `nobody` (`CMDOP_TOOL_USER`), file tools included. Markers live under /var/tmp: the
sandbox's private /tmp could not hide a write there.
"""

from __future__ import annotations

import os
import pwd
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from random import Random

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.procs import file_servers_of, gone_within, wait_for

from ..conftest import PolicyBase, run_tool_calls
from .conftest import stop_machines

pytestmark = pytest.mark.integration

# Made at run time: the checkout itself may lie under /tmp, shown read-only in the
# sandbox, and a grep there must not find the secret in this very file.
SECRET = f"jail-host-secret-{uuid.uuid4().hex[:8]}"
BIG_LINE_MIB = 120
TOOL_USER = "nobody"
MACHINES = ("box", "slow", "as-nobody")


@dataclass
class Box:
    client: Client
    fake: FakeAnthropic
    fleet: LocalFleet
    markers: Path  # nothing writable here
    granted: Path  # the sandbox's writable path

    def calls(self, uses: list[tuple[str, dict[str, object]]], machine: str = "box") -> list[Event]:
        """One run making every call at once; the TOOL_ENDs in call order."""
        blocks = [{"name": tool, "input": tool_input} for tool, tool_input in uses]
        return run_tool_calls(self.client, self.fake, machine, blocks)

    def worker_pid(self, machine: str = "box") -> int:
        return self.fleet.workers[machine].pid


@pytest.fixture(scope="module")
def box(plain_base: PolicyBase, fake_model: FakeAnthropic) -> Iterator[Box]:
    markers = Path(f"/var/tmp/cmdop-jail-{uuid.uuid4().hex[:8]}")
    granted = markers / "granted"
    granted.mkdir(parents=True)
    policy = markers / "policy.toml"
    policy.write_text(f'mode = "bypass"\n[sandbox]\nwritable = ["{granted}"]\n')
    fleet = plain_base.fleet
    own = {"CMDOP_POLICY_FILE": str(policy), "CMDOP_WORKER_CONCURRENCY": "8"}
    try:
        for machine in ("box", "slow"):
            fleet.start_machine(machine, own)
        fleet.start_machine("as-nobody", {**own, "CMDOP_TOOL_USER": TOOL_USER})
        fleet.wait_ready(MACHINES, timeout_s=60)
        with Client(Settings(redis_url=plain_base.server.url)) as client:
            yield Box(client, fake_model, fleet, markers, granted)
    finally:
        stop_machines(plain_base, MACHINES)
        shutil.rmtree(markers, ignore_errors=True)


def test_write_file_writes_only_where_touch_could(box: Box) -> None:
    outside, inside = box.markers / "by-write-file", box.granted / "by-write-file"
    touched = box.markers / "by-touch"
    write_out, touch_out, write_in = box.calls(
        [
            ("write_file", {"path": str(outside), "content": "owned"}),
            ("execute_command", {"command": f"touch {touched}"}),
            ("write_file", {"path": str(inside), "content": "fine"}),
        ]
    )
    assert write_out.data["status"] == "error", write_out.data
    assert "Read-only file system" in write_out.data["output"]
    assert not outside.exists() and not touched.exists()
    assert "Read-only file system" in touch_out.data["output"]  # the same wall for both
    assert write_in.data["status"] == "ok", write_in.data
    assert inside.read_text() == "fine"


def test_read_file_sees_the_sandboxs_tmp_and_run_not_the_hosts(box: Box) -> None:
    name = f"cmdop-host-{uuid.uuid4().hex[:8]}"
    host_files = [Path("/tmp") / name, Path("/run") / name]
    for path in host_files:
        path.write_text(SECRET)
    try:
        reads = [("read_file", {"path": str(path)}) for path in host_files]
        near_secret = SECRET[:-1] + "."  # matches it, but is not it
        ends = box.calls(
            [
                *reads,
                ("list_dir", {"path": "/run"}),
                ("grep", {"pattern": near_secret, "path": "/tmp"}),
            ]
        )
    finally:
        for path in host_files:
            path.unlink()
    assert [e.data["status"] for e in ends[:2]] == ["error", "error"], ends
    assert all("No such file" in e.data["output"] for e in ends[:2])
    assert ends[2].data["status"] == "ok" and name not in ends[2].data["output"]
    assert ends[3].data["output"].startswith("no matches for"), ends[3].data
    assert all(SECRET not in e.data["output"] for e in ends)


def test_a_fifo_is_refused_at_once_and_the_worker_serves_on(box: Box) -> None:
    tree = box.granted / f"fifo-{uuid.uuid4().hex[:6]}"
    tree.mkdir()
    (tree / "plain.txt").write_text("needle here\n")
    os.mkfifo(tree / "pipe")  # nobody ever writes it: a blocking open would hang
    grep, read = box.calls(
        [
            ("grep", {"pattern": "needle", "path": str(tree)}),
            ("read_file", {"path": str(tree / "pipe")}),
        ]
    )
    assert grep.data["status"] == "ok", grep.data
    assert grep.data["output"] == f"{tree}/plain.txt:1: needle here"
    assert read.data["status"] == "error", read.data
    assert "not a regular file" in read.data["output"]
    (after,) = box.calls([("read_file", {"path": str(tree / "plain.txt")})])
    assert after.data["status"] == "ok" and "needle here" in after.data["output"]


def vm_hwm_kib(pid: int) -> int:
    """The process's peak resident memory."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_huge_single_line_is_read_in_bounded_memory(box: Box) -> None:
    big = box.granted / "one-line.txt"
    with big.open("wb") as fh:
        chunk = b"x" * (1024 * 1024)
        for _ in range(BIG_LINE_MIB):
            fh.write(chunk)
    worker = box.worker_pid()
    before = vm_hwm_kib(worker)
    (end,) = box.calls([("read_file", {"path": str(big)})])
    assert end.data["status"] == "ok", end.data
    assert end.data["output"] == "     1\t" + "x" * 2000 + " …[line truncated]"
    grown_mib = (vm_hwm_kib(worker) - before) / 1024
    assert grown_mib < BIG_LINE_MIB / 4, f"the worker grew by {grown_mib:.0f} MiB"
    servers = file_servers_of(worker)
    assert servers, "no sandboxed file server found under the worker"
    assert max(vm_hwm_kib(pid) for pid in servers) / 1024 < BIG_LINE_MIB / 2
    big.unlink()


def test_glob_stays_in_its_tree_through_a_linked_directory(box: Box) -> None:
    tree = box.granted / f"glob-{uuid.uuid4().hex[:6]}"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "hostname").write_text("mine\n")
    (tree / "etc").symlink_to("/etc")
    through, listing = box.calls(
        [
            ("glob", {"pattern": "*/hostname", "path": str(tree)}),
            ("glob", {"pattern": "*", "path": str(tree)}),
        ]
    )
    assert through.data["output"] == f"{tree}/sub/hostname", through.data
    assert listing.data["output"] == f"{tree}/etc/\n{tree}/sub/", listing.data  # the link itself


@pytest.mark.timeout(120)  # a hang guard: Python's `re` takes hours on the first line
def test_a_backtracking_grep_pattern_answers_at_once(box: Box) -> None:
    crafted = box.granted / f"crafted-{uuid.uuid4().hex[:6]}.txt"
    crafted.write_text("a" * 30 + "b\n" + "a" * 40 + "\n")
    found, refused = box.calls(
        [
            ("grep", {"pattern": "(a+)+$", "path": str(crafted)}),
            ("grep", {"pattern": r"(a)\1", "path": str(crafted)}),
        ]
    )
    assert found.data["status"] == "ok", found.data
    assert found.data["output"] == f"{crafted}:2: {'a' * 40}"
    assert refused.data["status"] == "invalid", refused.data
    assert "grep uses RE2 syntax" in refused.data["output"]


def test_a_ui_cancel_stops_a_slow_file_call_and_its_server(box: Box) -> None:
    slow = box.granted / "heavy.txt"
    random = Random(7)
    with slow.open("w") as out:  # 300 lines of 64 KiB, each searched in full
        for _ in range(300):
            out.write("".join(random.choices("ab", k=65_000)) + "\n")
    name = f"slow{uuid.uuid4().hex[:8]}"
    # RE2 matches in linear time, but this pattern's automaton outgrows RE2's cache, so
    # each line takes a large constant: the call runs for minutes, long past the cancel.
    pattern = "(?:[ab]*a[ab]{30}){30}x"
    grep = {"type": "tool_use", "name": "grep", "input": {"pattern": pattern, "path": str(slow)}}
    box.fake.add_script(name, [[grep], [{"type": "text", "text": "done"}]])
    run = box.client.submit(prompt=f"[[script:{name}]] go", machine="slow", timeout_s=120)
    for event in run.events():
        if event.type == "TOOL_START":
            break
    (server,) = wait_for(lambda: file_servers_of(box.worker_pid("slow")), 10, "a file server")
    assert run.cancel(ui=True, reason="stop the grep")
    ends = [e for e in run.events(idle_timeout_s=10) if e.type == "TOOL_END"]
    assert [e.data["status"] for e in ends] == ["cancelled"], ends
    assert gone_within(server, 5), "the file server survived a ui cancel"
    (after,) = box.calls([("list_dir", {"path": str(box.granted)})], machine="slow")
    assert after.data["status"] == "ok" and "heavy.txt" in after.data["output"]


@pytest.mark.skipif(os.geteuid() != 0, reason="a tool user needs a root worker")
def test_file_tools_run_as_the_tool_user(box: Box) -> None:
    tree = box.granted / f"user-{uuid.uuid4().hex[:6]}"
    tree.mkdir()
    tree.chmod(0o777)  # nobody may create files here, the sandbox lets it
    private = tree / "root-only.txt"
    private.write_text(SECRET)
    private.chmod(0o600)
    (tree / "open.txt").write_text("for anyone\n")
    made = tree / "made.txt"
    hidden, shown, written = box.calls(
        [
            ("read_file", {"path": str(private)}),
            ("read_file", {"path": str(tree / "open.txt")}),
            ("write_file", {"path": str(made), "content": "by nobody"}),
        ],
        machine="as-nobody",
    )
    assert hidden.data["status"] == "error" and "Permission denied" in hidden.data["output"]
    assert SECRET not in hidden.data["output"]
    assert shown.data["status"] == "ok" and "for anyone" in shown.data["output"]
    assert written.data["status"] == "ok", written.data
    assert made.stat().st_uid == pwd.getpwnam(TOOL_USER).pw_uid
