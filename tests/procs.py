"""Waiting in tests: for a condition, for a tool to start, for a process to be gone.
Every wait is bounded and names what it waited for when it gives up.

A tool runs in its own PID namespace, so `$$` inside it is no host pid: a test that
needs the host pid of a tool's process runs a `sleeper` (a `sleep` with a duration no
other process has) and finds it with `wait_for_sleeper`."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """The first truthy value `check` returns within `timeout_s`; AssertionError if none."""
    give_up = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= give_up:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.02)


def process_gone(pid: int) -> bool:
    """Gone, or a zombie (killed, waiting to be reaped by whoever inherited it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it exited mid-read
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def gone_within(pid: int, timeout_s: float) -> bool:
    """Whether the process is gone by `timeout_s` from now."""
    give_up = time.monotonic() + timeout_s
    while not process_gone(pid):
        if time.monotonic() >= give_up:
            return False
        time.sleep(0.01)
    return True


_serial = itertools.count(1)


def sleeper(seconds: int) -> str:
    """`sleep N.xxxxxxxx`: about `seconds` long, and a command line of its own."""
    return f"sleep {seconds}.{os.getpid() % 10_000:04d}{next(_serial):04d}"


def sleeping_pids(command: str) -> list[int]:
    """Host pids of processes whose argv is exactly `command` (a `sleeper`)."""
    wanted = command.split()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:  # gone while being read
            continue
        if argv and os.path.basename(argv[0]) == wanted[0] and argv[1:] == wanted[1:]:
            found.append(int(entry.name))
    return found


def wait_for_sleeper(command: str, timeout_s: float = 10) -> int:
    """The host pid of a tool's `sleeper` once it has started."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        pids = sleeping_pids(command)
        if pids:
            return pids[0]
        time.sleep(0.01)
    raise AssertionError("the tool never started")


def ui_cancel_stops(run: Any, pid: int, within_s: float = 20) -> None:
    """A ui cancel ends `run` (a `client.Run`) cancelled from the ui channel, and the
    tool process `pid` is gone within `within_s` of asking. Give the tool a longer
    sleep than that, so one the cancel did not reach is still alive when this fails."""
    asked = time.monotonic()
    assert run.cancel(ui=True)
    result = run.wait(timeout=15, raise_on_failure=False)
    assert result.status == "cancelled"
    assert result.cancel is not None and result.cancel.channel == "ui"
    left_s = max(0.0, asked + within_s - time.monotonic())
    assert gone_within(pid, left_s), "the ui cancel did not kill the tool"


def file_servers_of(ancestor: int) -> list[int]:
    """Host pids of the sandboxed file servers a process started (bwrap in between)."""
    return servers_of(ancestor, b"cmdop_worker.machine.fileserver")


def servers_of(ancestor: int, module: bytes) -> list[int]:
    """Host pids of the Python processes running `-m module` that descend from
    `ancestor`: not the bwrap or bridge on the way, whose command lines name it later."""
    parents: dict[int, int] = {}
    servers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):  # gone while being read
            continue
        parents[int(entry.name)] = ppid
        if _runs_module(argv, module):
            servers.append(int(entry.name))

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == ancestor:
                return True
        return False

    return [pid for pid in servers if descends(pid)]


def _runs_module(argv: list[bytes], module: bytes) -> bool:
    """`python [flags] -m module ...`: only interpreter flags (`-W` and `-X` with their
    values) before `-m`."""
    words = iter(argv[1:])
    for word in words:
        if word == b"-m":
            return next(words, None) == module
        if word in (b"-W", b"-X"):
            next(words, None)
        elif not word.startswith(b"-"):
            return False
    return False
