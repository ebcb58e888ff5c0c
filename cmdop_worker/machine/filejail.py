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
call starts a fresh one. How a server is started and spoken to is `fileproc`'s.

The same pool holds the servers that host the operator's own Python tools (`tooljail`):
a server's `Hosting` is part of its key, so a user tool never lands on a file tools'
server (which has no network) nor a file tool on one with the call's network. A user
tool is never tried twice: it may have done half its work before its server died.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cmdop_worker.machine.fileops import Budget, FileReply
from cmdop_worker.machine.fileproc import FILE_TOOLS_ONLY, FileServer, FileServerError, Hosting
from cmdop_worker.machine.fileserver import dispatch, encode_request
from cmdop_worker.machine.sandbox import Confinement
from cmdop_worker.machine.toolcall import ToolContext

log = logging.getLogger(__name__)

SERVERS_PER_JAIL = 4
START_TIMEOUT_S = 20.0
KILL_GRACE_S = 1.0
POLL_S = 0.01
_WARMER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-server-warm")


def run_file_tool(tool: str, args: Mapping[str, Any], ctx: ToolContext) -> FileReply:
    """Run a file tool where the call's commands would run."""
    jail = ctx.jail
    if jail is None or jail.bwrap is None:
        budget = Budget(ctx.deadline_monotonic, ctx.output_max_bytes, ctx.cancelled.is_set)
        return dispatch(tool, args, budget)
    request = encode_request(tool, args, ctx.remaining_s(), ctx.output_max_bytes)
    return pool().call(tool, request, jail, ctx)


def jail_key(jail: Confinement, cwd: str, hosting: Hosting = FILE_TOOLS_ONLY) -> str:
    """Equal for confinements that would build the same sandbox and server."""
    parts = [dataclasses.asdict(jail), cwd, dataclasses.asdict(hosting)]
    return json.dumps(parts, sort_keys=True, default=repr)


class FilePool:
    """Idle servers per confinement, at most `per_jail` started per confinement."""

    def __init__(self, per_jail: int = SERVERS_PER_JAIL) -> None:
        self.per_jail = per_jail
        self._cond = threading.Condition()
        self._idle: dict[str, list[FileServer]] = {}
        self._started: dict[str, int] = {}
        self._closed = False

    def call(
        self,
        tool: str,
        request: bytes,
        jail: Confinement,
        ctx: ToolContext,
        hosting: Hosting = FILE_TOOLS_ONLY,
    ) -> FileReply:
        """One call on a server of this confinement; for a file tool, once more on a
        fresh one if it died."""
        cwd = ctx.cwd or os.getcwd()
        key = jail_key(jail, cwd, hosting)
        until = ctx.deadline_monotonic + KILL_GRACE_S
        for _ in range(1 if hosting.modules else 2):
            try:
                server = self._acquire(key, jail, cwd, until, ctx.cancelled, hosting)
            except FileServerError as exc:
                return FileReply(f"{tool} could not run: {exc}", "error")
            if isinstance(server, str):
                return stopped_reply(tool, server, hosting)
            answer = server.ask(request, until, ctx.cancelled)
            self._release(key, server, keep=isinstance(answer, FileReply))
            if isinstance(answer, FileReply):
                return answer
            if answer != "died":
                _WARMER.submit(self.warm, jail, cwd, hosting)  # the next call finds one ready
                return stopped_reply(tool, answer, hosting)
            log.warning("the sandboxed server died running %s", tool)
        if hosting.modules:
            return FileReply(f"{tool} failed: its sandboxed tool server died running it", "error")
        return FileReply(f"{tool} failed: its sandboxed file server died twice running it", "error")

    def _acquire(
        self,
        key: str,
        jail: Confinement,
        cwd: str,
        until: float,
        cancelled: threading.Event,
        hosting: Hosting,
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
            server = FileServer(jail, cwd, hosting)
            stop = server.wait_ready(start_until, cancelled)
        except (OSError, KeyError) as exc:  # no bwrap; KeyError: no such tool user
            self._release(key, None, keep=False)
            raise FileServerError(f"the {hosting.noun} did not start ({exc})") from exc
        except BaseException:
            self._release(key, None, keep=False)
            raise
        if stop is not None:
            self._release(key, None, keep=False)
            if stop == "timeout" and start_until < until:
                why = f"the {hosting.noun} did not start within {START_TIMEOUT_S:g} s"
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

    def warm(self, jail: Confinement, cwd: str, hosting: Hosting = FILE_TOOLS_ONLY) -> None:
        """Start an idle server for this confinement, unless it has its full count."""
        key = jail_key(jail, cwd, hosting)
        with self._cond:
            if jail.bwrap is None or self._closed or self._started.get(key, 0) >= self.per_jail:
                return
            self._started[key] = self._started.get(key, 0) + 1
            self._idle.setdefault(key, [])
        server = None
        try:
            server = FileServer(jail, cwd, hosting)
            if server.wait_ready(time.monotonic() + START_TIMEOUT_S, threading.Event()) is not None:
                server = None
        except (OSError, FileServerError, RuntimeError) as exc:  # RuntimeError: exiting
            log.warning("could not start a sandboxed file server ahead of use: %s", exc)
            server = None
        finally:  # whatever failed, the slot is given back (else the key fills for good)
            self._release(key, server, keep=server is not None)

    def warm_later(self, jail: Confinement, cwd: str, hosting: Hosting) -> None:
        """`warm`, in the background."""
        _WARMER.submit(self.warm, jail, cwd, hosting)

    def close(self) -> None:
        """Stop the idle servers; servers warmed from now on are stopped as they start."""
        with self._cond:
            self._closed = True
            servers = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for server in servers:
            server.kill()


def stopped_reply(tool: str, reason: str, hosting: Hosting = FILE_TOOLS_ONLY) -> FileReply:
    if reason == "cancelled":
        return FileReply(f"{tool} cancelled; its {hosting.noun} was stopped", "cancelled")
    noun = hosting.noun.removeprefix("sandboxed ")
    return FileReply(f"{tool} stopped at the deadline; its {noun} was stopped", "timeout")


_pools: dict[int, FilePool] = {}
_pools_lock = threading.Lock()


def pool() -> FilePool:
    """This process's pool (a forked child gets its own, never its parent's pipes)."""
    with _pools_lock:
        return _pools.setdefault(os.getpid(), FilePool())
