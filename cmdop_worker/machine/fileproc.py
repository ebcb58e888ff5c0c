"""One sandboxed file server process: how it is started, and one call on it.

`server_argv` builds its bwrap command line with `sandbox.confined_argv` from the
call's confinement, so every wall a command meets (read-only root, writable grants,
private `/tmp` and `/run`, the floor's blanked files, a bounded `/tmp`) holds for the
file tools too. A file tools' server gets no network; one that hosts the operator's
own Python tools (`Hosting`: their modules, imported at its start) gets the call's,
through the egress proxy as a command does. Either sees the Python it runs on even
when that lives under a private tree (a virtualenv under `/tmp`), and works as the
tool user (`CMDOP_TOOL_USER`) when there is one. `FileServer` speaks its JSON-lines protocol
(`fileserver`), watching the call's deadline and cancel while it waits. Used by the
pool in `filejail`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cmdop_worker.machine.bounds import ids_of
from cmdop_worker.machine.fileops import FileReply
from cmdop_worker.machine.sandbox import Confinement, bridged, confined_argv

POLL_S = 0.01
MAX_REPLY_BYTES = 16 * 1024 * 1024
SERVER_MODULE = "cmdop_worker.machine.fileserver"
TOOL_SERVER_MODULE = "cmdop_worker.machine.toolserve"  # one that hosts user tools
# bwrap dies with the thread that started it (PR_SET_PDEATHSIG is per thread), so
# servers are started by one thread that lives as long as the process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-server-start")


class FileServerError(RuntimeError):
    """A sandboxed file server could not start, or ended without answering."""


@dataclass(frozen=True)
class Hosting:
    """The operator's tool modules a server imports at its start, and the import roots
    they came from (shown to it read-only; `-I` ignores `PYTHONPATH`). Empty: a file
    tools' server."""

    modules: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()

    @property
    def noun(self) -> str:
        """What its errors call the server."""
        return "sandboxed tool server" if self.modules else "sandboxed file server"

    def args(self) -> list[str]:
        if not self.modules:
            return []
        return ["--tool-modules", json.dumps(self.modules), "--tool-paths", json.dumps(self.paths)]


FILE_TOOLS_ONLY = Hosting()


def runtime_paths() -> tuple[str, ...]:
    """What the server's Python needs to see: its prefixes, its binary, this package."""
    package = Path(__file__).resolve().parent.parent
    paths = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent)}
    return tuple(sorted({os.path.realpath(p) for p in paths} | {str(package)}))


def server_jail(jail: Confinement, hosting: Hosting = FILE_TOOLS_ONLY) -> Confinement:
    """The call's confinement for the server: its own Python and the tool modules'
    roots shown; no network for the file tools, the call's own for user tools."""
    reachable = tuple(dict.fromkeys((*jail.reachable, *runtime_paths(), *hosting.paths)))
    network = jail.network and bool(hosting.modules)
    return dataclasses.replace(jail, network=network, reachable=reachable)


def server_argv(jail: Confinement, cwd: str, hosting: Hosting = FILE_TOOLS_ONLY) -> list[str]:
    """bwrap running the server. With a tool user, the server starts as the worker's
    user, so it can load the worker's Python (often in a home the tool user cannot
    enter), and becomes the tool user before it serves: bwrap leaves it only the
    right to change its ids, which the change itself then drops."""
    module = TOOL_SERVER_MODULE if hosting.modules else SERVER_MODULE
    command = [sys.executable, "-I", "-W", "ignore", "-m", module, *limit_args(jail)]
    command += [*hosting.args(), *(become_args(jail.user) if jail.user else [])]
    boxed = server_jail(jail, hosting)
    argv = confined_argv(command, boxed, cwd)
    if not jail.user:
        return argv
    if boxed.network and boxed.egress is not None:  # started by the bridge
        command = bridged(command, boxed.egress)
    cut = len(argv) - len(command) - 1
    assert argv[cut] == "--", argv
    options = shared_tmp(argv[:cut])
    return [*options, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", *argv[cut:]]


def shared_tmp(options: list[str]) -> list[str]:
    """The private /tmp made by the worker's user, open to the tool user as a host's
    is (mode 1777), so a tool's `tempfile` works once the server changed its ids."""
    out: list[str] = []
    for i, arg in enumerate(options):
        if arg == "--tmpfs" and options[i + 1 : i + 2] == ["/tmp"]:
            out += ["--perms", "1777"]
        out.append(arg)
    return out


def limit_args(jail: Confinement) -> list[str]:
    """The call's memory and file size limits, which the server sets on itself: it
    outlives calls, so it is in no call's cgroup and its memory is held by rlimit."""
    limits = jail.bounds.limits if jail.bounds is not None else None
    if limits is None:
        return []
    return ["--memory-mb", str(limits.max_memory_mb), "--file-mb", str(limits.max_file_size_mb)]


def become_args(user: str) -> list[str]:
    """The server's `--uid`, `--gid` and `--groups` for the tool user."""
    ids = ids_of(user)  # a name or a bare number, as the command tools take it
    groups = ",".join(str(g) for g in ids.groups)
    return ["--uid", str(ids.uid), "--gid", str(ids.gid), "--groups", groups]


class FileServer:
    """One sandboxed server process and its two pipes."""

    def __init__(self, jail: Confinement, cwd: str, hosting: Hosting = FILE_TOOLS_ONLY) -> None:
        self.proc = _SPAWNER.submit(_start, jail, cwd, hosting).result()
        self.noun = hosting.noun
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
        raise FileServerError(f"the {self.noun} did not start ({why})")

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


def _start(jail: Confinement, cwd: str, hosting: Hosting) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        server_argv(jail, cwd, hosting),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        cwd=cwd,
        env=dict(jail.env),
    )
