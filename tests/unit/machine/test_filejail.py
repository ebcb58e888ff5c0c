"""The pool of sandboxed file servers (`filejail`, `fileproc`), with real bubblewrap."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from random import Random

import pytest

from cmdop_worker.machine import filejail, fileproc
from cmdop_worker.machine.bounds import ids_of
from cmdop_worker.machine.filejail import FilePool, jail_key
from cmdop_worker.machine.fileproc import server_argv
from cmdop_worker.machine.sandbox import Confinement, find_bwrap, tool_env
from cmdop_worker.machine.toolcall import ToolContext
from tests.procs import file_servers_of, gone_within, wait_for

BWRAP = find_bwrap()
needs_bwrap = pytest.mark.skipif(BWRAP is None, reason="no bwrap binary")


def jail(*writable: str) -> Confinement:
    return Confinement(bwrap=BWRAP, writable=writable, env=tool_env(os.environ))


def ctx(box: Confinement, cwd: Path, cancelled: threading.Event | None = None) -> ToolContext:
    deadline = time.monotonic() + 20
    event = cancelled or threading.Event()
    return ToolContext("m", "r", "t", deadline, event, cwd=str(cwd), jail=box)


def ask(pool: FilePool, box: Confinement, cwd: Path, tool: str, **args: object):  # type: ignore[no-untyped-def]
    request = filejail.encode_request(tool, args, 20.0, 64_000)
    return pool.call(tool, request, box, ctx(box, cwd))


def test_equal_confinements_share_a_key_and_different_ones_do_not() -> None:
    assert jail_key(jail("/a"), "/w") == jail_key(jail("/a"), "/w")
    assert jail_key(jail("/a"), "/w") != jail_key(jail("/b"), "/w")
    assert jail_key(jail("/a"), "/w") != jail_key(jail("/a"), "/x")


def test_the_server_has_no_network_and_sees_its_python_under_a_private_tmp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fileproc, "runtime_paths", lambda: ("/tmp/venv-x", "/usr"))
    argv = server_argv(jail(), "/")
    assert "--unshare-net" in argv
    shown = {argv[i + 1] for i, arg in enumerate(argv) if arg == "--ro-bind-try"}
    assert "/tmp/venv-x" in shown and "/usr" not in shown  # /usr is in the read-only root


@needs_bwrap
def test_a_killed_server_is_replaced_and_the_call_answered(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("hello\n")
    pool, box = FilePool(per_jail=1), jail()
    try:
        assert ask(pool, box, tmp_path, "list_dir", path=str(tmp_path)).status == "ok"
        (server,) = pool._idle[jail_key(box, str(tmp_path))]
        os.killpg(server.proc.pid, signal.SIGKILL)
        assert gone_within(server.proc.pid, 5)
        reply = ask(
            pool, box, tmp_path, "read_file", path=str(tmp_path / "f.txt"), offset=0, limit=5
        )
        assert (reply.status, reply.output) == ("ok", "     1\thello")
    finally:
        pool.close()


@needs_bwrap
def test_a_server_that_cannot_start_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fileproc, "SERVER_MODULE", "cmdop_worker.no_such_module")
    pool = FilePool()
    reply = ask(pool, jail(), tmp_path, "list_dir", path=str(tmp_path))
    assert reply.status == "error"
    assert reply.output.startswith(
        "list_dir could not run: the sandboxed file server did not start"
    )
    assert "No module named cmdop_worker.no_such_module" in reply.output


# RE2 matches in linear time, but this pattern's automaton outgrows RE2's cache, so each
# 64 KiB line takes a large constant: a grep over `heavy_file` keeps its server busy in
# one search, with no deadline check between, for far longer than any of these tests.
SLOW_PATTERN = "(?:[ab]*a[ab]{30}){30}x"


def heavy_file(where: Path) -> Path:
    path = where / "heavy.txt"
    random = Random(7)
    with path.open("w") as out:
        for _ in range(100):
            out.write("".join(random.choices("ab", k=65_000)) + "\n")
    return path


@needs_bwrap
def test_a_cancel_kills_the_busy_server(tmp_path: Path) -> None:
    slow = heavy_file(tmp_path)
    pool, box = FilePool(), jail()
    cancelled = threading.Event()
    replies = []
    request = filejail.encode_request(
        "grep", {"pattern": SLOW_PATTERN, "path": str(slow)}, 20.0, 64_000
    )
    worker = threading.Thread(
        target=lambda: replies.append(
            pool.call("grep", request, box, ctx(box, tmp_path, cancelled))
        )
    )
    try:
        worker.start()
        deadline = time.monotonic() + 20
        while not pool._started.get(jail_key(box, str(tmp_path))) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the server is in the regex now
        cancelled.set()
        worker.join(10)
        assert not worker.is_alive()
        (reply,) = replies
        assert reply.status == "cancelled" and "file server was stopped" in reply.output
    finally:
        pool.close()


@needs_bwrap
def test_a_server_that_dies_twice_under_a_call_is_a_clear_error(tmp_path: Path) -> None:
    slow = heavy_file(tmp_path)
    pool, box = FilePool(), jail()
    replies = []
    request = filejail.encode_request(
        "grep", {"pattern": SLOW_PATTERN, "path": str(slow)}, 20.0, 64_000
    )
    worker = threading.Thread(
        target=lambda: replies.append(pool.call("grep", request, box, ctx(box, tmp_path)))
    )
    try:
        worker.start()
        killed: set[int] = set()
        for _ in range(2):  # the first server, then the one that takes the call again
            fresh = wait_for(lambda: servers_in(tmp_path) - killed, 20, "a server")
            (pid,) = fresh
            wait_for(lambda: cpu_ticks(pid) >= 50, 20, "the server in the regex")  # noqa: B023
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        worker.join(20)
        (reply,) = replies
        assert reply.status == "error"
        assert reply.output == "grep failed: its sandboxed file server died twice running it"
    finally:
        pool.close()


def cpu_ticks(pid: int) -> int:
    """User and system time the process has used, in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def servers_in(cwd: Path) -> set[int]:
    """This process's file servers working in `cwd` (other tests' pools work elsewhere)."""
    found = set()
    for pid in file_servers_of(os.getpid()):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(cwd):
                found.add(pid)
        except OSError:
            continue
    return found


@needs_bwrap
def test_a_call_past_its_deadline_is_stopped_with_its_server(tmp_path: Path) -> None:
    # Every file tool checks its deadline as it goes, so a server that outlives one is a
    # server that stopped answering: a stopped process stands in for it.
    pool, box = FilePool(), jail()
    listing = filejail.encode_request("list_dir", {"path": str(tmp_path)}, 20.0, 64_000)
    try:
        assert pool.call("list_dir", listing, box, ctx(box, tmp_path)).status == "ok"
        (pid,) = servers_in(tmp_path)
        os.kill(pid, signal.SIGSTOP)
        request = filejail.encode_request("list_dir", {"path": str(tmp_path)}, 0.2, 64_000)
        late = ToolContext(
            "m", "r", "t", time.monotonic() + 0.2, threading.Event(), cwd=str(tmp_path), jail=box
        )
        reply = pool.call("list_dir", request, box, late)
        assert (reply.status, reply.output) == (
            "timeout",
            "list_dir stopped at the deadline; its file server was stopped",
        )
        assert gone_within(pid, 10)
    finally:
        pool.close()


def test_only_a_tool_user_s_server_keeps_the_right_to_change_its_ids() -> None:
    plain = server_argv(jail(), "/")
    assert "--cap-add" not in plain and "--uid" not in plain
    as_user = server_argv(Confinement(bwrap=BWRAP or "bwrap", user="nobody"), "/")
    cut = as_user.index("--")
    assert as_user[cut - 4 : cut] == ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    assert as_user[as_user.index("--uid") + 1] == str(pwd.getpwnam("nobody").pw_uid)
    assert as_user.index("--uid") > cut  # the server's own argument, not bwrap's


def test_the_server_holds_itself_to_the_call_s_file_size_limit(tmp_path: Path) -> None:
    server = subprocess.run(
        [
            sys.executable,
            "-I",
            "-m",
            fileproc.SERVER_MODULE,
            "--memory-mb",
            "256",
            "--file-mb",
            "1",
        ],
        input=filejail.encode_request(
            "write_file", {"path": str(tmp_path / "big"), "content": "x" * 2_000_000}, 10.0, 64_000
        ),
        capture_output=True,
        timeout=60,
    )
    ready, reply = server.stdout.splitlines()
    assert json.loads(ready)["ready"]
    answer = json.loads(reply)
    assert answer["status"] == "error" and "File too large" in answer["output"], answer
    assert not (tmp_path / "big").exists()


def test_a_numeric_tool_user_gets_its_ids_as_the_command_tools_do() -> None:
    ids = ids_of("54321")  # no passwd entry: the nobody group
    assert fileproc.become_args("54321") == [
        "--uid",
        "54321",
        "--gid",
        str(ids.gid),
        "--groups",
        ",".join(str(g) for g in ids.groups),
    ]
    assert fileproc.become_args("65534")[:2] == ["--uid", "65534"]


@needs_bwrap
def test_a_warm_start_that_fails_unexpectedly_gives_its_slot_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise ValueError("unexpected")

    pool, box = FilePool(per_jail=1), jail()
    try:
        with monkeypatch.context() as patched:
            patched.setattr(filejail, "FileServer", broken)
            with pytest.raises(ValueError):
                pool.warm(box, str(tmp_path))
        assert pool._started[jail_key(box, str(tmp_path))] == 0
        assert ask(pool, box, tmp_path, "list_dir", path=str(tmp_path)).status == "ok"
    finally:
        pool.close()
