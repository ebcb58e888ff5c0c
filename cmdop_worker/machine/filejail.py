"""The file tools run in the call's sandbox: a pool of long-lived sandboxed file servers.

`run_file_tool` is what the built-in file tools call. With the sandbox off (no jail,
or `CMDOP_SANDBOX=off`) it runs the tool in this process. Otherwise it hands the call
to a `fileserver` started inside bubblewrap with the call's own `Confinement`, built
by the same `sandbox.confined_argv` as a command's: `write_file` writes only where
`touch` could, and `read_file` sees the sandbox's private `/tmp` and `/run`, not the
host's. Starting bwrap and Python per call would cost tens of milliseconds, so servers
live on, one pool per distinct confinement (there are few: allowed, approved), at most
`SERVERS_PER_JAIL` each, one call at a time per server; a call is a pipe round trip.

A server that dies under a call is replaced and the call tried once more, then the
call fails with the reason. A ui cancel, or a call that outlives its deadline by
`KILL_GRACE_S`, kills the server (and with it everything in its sandbox); the next
call starts a fresh one. The server gets no network, sees the Python it runs on even
when that lives under a private tree (a virtualenv under `/tmp`), and works as the
tool user (`CMDOP_TOOL_USER`) when there is one, as commands do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pwd
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cmdop_worker.machine.fileops import Budget, FileReply
from cmdop_worker.machine.fileserver import dispatch, encode_request
from cmdop_worker.machine.sandbox import Confinement, confined_argv
from cmdop_worker.machine.toolbox import ToolContext

log = logging.getLogger(__name__)

SERVERS_PER_JAIL = 4
START_TIMEOUT_S = 20.0
KILL_GRACE_S = 1.0
POLL_S = 0.01
MAX_REPLY_BYTES = 16 * 1024 * 1024
SERVER_MODULE = "cmdop_worker.machine.fileserver"
# bwrap dies with the thread that started it (PR_SET_PDEATHSIG is per thread), so
# servers are started by one thread that lives as long as the process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-server-start")
_WARMER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-server-warm")


class FileServerError(RuntimeError):
    """A sandboxed file server could not start, or ended without answering."""


def run_file_tool(tool: str, args: Mapping[str, Any], ctx: ToolContext) -> FileReply:
    """Run a file tool where the call's commands would run."""
    jail = ctx.jail
    if jail is None or jail.bwrap is None:
        budget = Budget(ctx.deadline_monotonic, ctx.output_max_bytes, ctx.cancelled.is_set)
        return dispatch(tool, args, budget)
    request = encode_request(tool, args, ctx.remaining_s(), ctx.output_max_bytes)
    return pool().call(tool, request, jail, ctx)


def runtime_paths() -> tuple[str, ...]:
    """What the server's Python needs to see: its prefixes, its binary, this package."""
    package = Path(__file__).resolve().parent.parent
    paths = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent)}
    return tuple(sorted({os.path.realpath(p) for p in paths} | {str(package)}))


def server_jail(jail: Confinement) -> Confinement:
    """The call's confinement for the server: no network, its own Python shown."""
    reachable = tuple(dict.fromkeys((*jail.reachable, *runtime_paths())))
    return dataclasses.replace(jail, network=False, reachable=reachable)


def server_argv(jail: Confinement, cwd: str) -> list[str]:
    """bwrap running the server. With a tool user, the server starts as the worker's
    user, so it can load the worker's Python (often in a home the tool user cannot
    enter), and becomes the tool user before it serves: bwrap leaves it only the
    right to change its ids, which the change itself then drops."""
    command = [sys.executable, "-I", "-W", "ignore", "-m", SERVER_MODULE]
    command += become_args(jail.user) if jail.user else []
    argv = confined_argv(command, server_jail(jail), cwd)
    if not jail.user:
        return argv
    cut = len(argv) - len(command) - 1
    assert argv[cut] == "--", argv
    return [*argv[:cut], "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", *argv[cut:]]


def become_args(user: str) -> list[str]:
    """The server's `--uid`, `--gid` and `--groups` for the tool user."""
    entry = pwd.getpwnam(user)
    groups = ",".join(str(g) for g in os.getgrouplist(user, entry.pw_gid))
    return ["--uid", str(entry.pw_uid), "--gid", str(entry.pw_gid), "--groups", groups]


def jail_key(jail: Confinement, cwd: str) -> str:
    """Equal for confinements that would build the same sandbox."""
    return json.dumps([dataclasses.asdict(jail), cwd], sort_keys=True, default=repr)


class FileServer:
    """One sandboxed server process and its two pipes."""

    def __init__(self, jail: Confinement, cwd: str) -> None:
        self.proc = _SPAWNER.submit(_start, jail, cwd).result()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)

    def wait_ready(self, until: float, cancelled: threading.Event) -> str | None:
        """None once it serves; "cancelled" or "timeout" if the call must stop first."""
        line = self._read_line(until, cancelled)
        if isinstance(line, bytes) and b'"ready"' in line:
            return None
        why = self._why(line)
        self.kill()
        if line in ("cancelled", "timeout"):
            return str(line)
        raise FileServerError(f"the sandboxed file server did not start ({why})")

    def ask(self, request: bytes, until: float, cancelled: threading.Event) -> FileReply | str:
        """The server's reply, or why there is none: "cancelled", "timeout", "died"."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return "died"
        line = self._read_line(until, cancelled)
        if isinstance(line, str):
            return line
        try:
            reply = json.loads(line)
            return FileReply(str(reply["output"]), str(reply["status"]))
        except (ValueError, KeyError, TypeError):
            return "died"

    def _read_line(self, until: float, cancelled: threading.Event) -> bytes | str:
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        buf = bytearray()
        while not buf.endswith(b"\n"):
            if cancelled.is_set():
                return "cancelled"
            left = until - time.monotonic()
            if left <= 0:
                return "timeout"
            if not self._selector.select(min(POLL_S, left)):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk or len(buf) + len(chunk) > MAX_REPLY_BYTES:
                return "died"
            buf += chunk
        return bytes(buf)

    def _why(self, outcome: bytes | str) -> str:
        if outcome != "died":
            return str(outcome)
        self.proc.wait()
        stderr = self.proc.stderr.read() if self.proc.stderr else b""
        last = stderr.decode(errors="replace").strip().splitlines()[-1:]
        return last[0] if last else f"exit code {self.proc.returncode}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._selector.close()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]


def _start(jail: Confinement, cwd: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        server_argv(jail, cwd),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        cwd=cwd,
        env=dict(jail.env),
    )


class FilePool:
    """Idle servers per confinement, at most `per_jail` started per confinement."""

    def __init__(self, per_jail: int = SERVERS_PER_JAIL) -> None:
        self.per_jail = per_jail
        self._cond = threading.Condition()
        self._idle: dict[str, list[FileServer]] = {}
        self._started: dict[str, int] = {}
        self._closed = False

    def call(self, tool: str, request: bytes, jail: Confinement, ctx: ToolContext) -> FileReply:
        """One call on a server of this confinement; once more on a fresh one if it died."""
        cwd = ctx.cwd or os.getcwd()
        key = jail_key(jail, cwd)
        until = ctx.deadline_monotonic + KILL_GRACE_S
        for _ in range(2):
            try:
                server = self._acquire(key, jail, cwd, until, ctx.cancelled)
            except FileServerError as exc:
                return FileReply(f"{tool} could not run: {exc}", "error")
            if isinstance(server, str):
                return stopped_reply(tool, server)
            answer = server.ask(request, until, ctx.cancelled)
            self._release(key, server, keep=isinstance(answer, FileReply))
            if isinstance(answer, FileReply):
                return answer
            if answer != "died":
                _WARMER.submit(self.warm, jail, cwd)  # the next call finds one ready
                return stopped_reply(tool, answer)
            log.warning("the sandboxed file server died running %s; starting another", tool)
        return FileReply(f"{tool} failed: its sandboxed file server died twice running it", "error")

    def _acquire(
        self, key: str, jail: Confinement, cwd: str, until: float, cancelled: threading.Event
    ) -> FileServer | str:
        with self._cond:
            while True:
                idle = self._idle.setdefault(key, [])
                while idle:
                    server = idle.pop()
                    if server.alive():
                        return server
                    self._started[key] -= 1
                    server.kill()
                if self._started.get(key, 0) < self.per_jail:
                    self._started[key] = self._started.get(key, 0) + 1
                    break
                if cancelled.is_set() or time.monotonic() >= until:
                    return "cancelled" if cancelled.is_set() else "timeout"
                self._cond.wait(POLL_S)
        start_until = min(until, time.monotonic() + START_TIMEOUT_S)
        try:
            server = FileServer(jail, cwd)
            stop = server.wait_ready(start_until, cancelled)
        except (OSError, KeyError) as exc:  # no bwrap; KeyError: no such tool user
            self._release(key, None, keep=False)
            raise FileServerError(f"the sandboxed file server did not start ({exc})") from exc
        except BaseException:
            self._release(key, None, keep=False)
            raise
        if stop is not None:
            self._release(key, None, keep=False)
            if stop == "timeout" and start_until < until:
                why = f"the sandboxed file server did not start within {START_TIMEOUT_S:g} s"
                raise FileServerError(why)
            return stop
        return server

    def _release(self, key: str, server: FileServer | None, *, keep: bool) -> None:
        if server is not None and not keep:
            server.kill()
        if server is not None and keep and self._closed:
            server.kill()
            keep = False
        with self._cond:
            if server is not None and keep:
                self._idle[key].append(server)
            else:
                self._started[key] -= 1
            self._cond.notify()

    def warm(self, jail: Confinement, cwd: str) -> None:
        """Start an idle server for this confinement, unless it has its full count."""
        key = jail_key(jail, cwd)
        with self._cond:
            if jail.bwrap is None or self._closed or self._started.get(key, 0) >= self.per_jail:
                return
            self._started[key] = self._started.get(key, 0) + 1
            self._idle.setdefault(key, [])
        server = None
        try:
            server = FileServer(jail, cwd)
            if server.wait_ready(time.monotonic() + START_TIMEOUT_S, threading.Event()) is not None:
                server = None
        except (OSError, FileServerError, RuntimeError) as exc:  # RuntimeError: exiting
            log.warning("could not start a sandboxed file server ahead of use: %s", exc)
            server = None
        self._release(key, server, keep=server is not None)

    def close(self) -> None:
        """Stop the idle servers; servers warmed from now on are stopped as they start."""
        with self._cond:
            self._closed = True
            servers = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for server in servers:
            server.kill()


def stopped_reply(tool: str, reason: str) -> FileReply:
    if reason == "cancelled":
        return FileReply(f"{tool} cancelled; its sandboxed file server was stopped", "cancelled")
    return FileReply(f"{tool} stopped at the deadline; its file server was stopped", "timeout")


_pools: dict[int, FilePool] = {}
_pools_lock = threading.Lock()


def pool() -> FilePool:
    """This process's pool (a forked child gets its own, never its parent's pipes)."""
    with _pools_lock:
        return _pools.setdefault(os.getpid(), FilePool())
