"""Run one shell command as a killable process group, capturing capped output.

Owns the child-process mechanics of the machine side: `run_command` starts
`<shell> -c COMMAND` in a new session (so it leads its own process group), feeds it
no stdin, reads stdout and stderr concurrently through one selector, and on timeout
or cancel sends SIGTERM and then SIGKILL to the whole group, so grandchildren such as
the `sleep` in `sh -c "sleep 30; echo"` die too. Called by the `execute_command`
built-in tool, which returns `ProcessResult.summary()` to the model; no Redis or
Celery here.

Given a `Confinement`, the command runs inside its bubblewrap sandbox (`sandbox`):
killing the group kills bwrap, and with it the sandbox's whole PID namespace, so a
process that left the group still dies. Unsandboxed (`CMDOP_SANDBOX=off`), processes
that left the group on purpose (`setsid`, a daemon double-fork) are not chased after a
normal exit: they are the user's business. A sandboxed call also gets its bounds
(`bounds`): its own cgroup and rlimits, joined and set before exec, and a line in its
result when a limit stopped it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

from cmdop_worker.machine.bounds import BoundCall, bound_call, ids_of
from cmdop_worker.machine.sandbox import Confinement, confined_argv

# threading has no wait-for-any; the supervisor blocks on the pipes' selector for at
# most this long before re-checking the cancel event and the child, which keeps the
# reaction to a cancel well inside ~20 ms.
POLL_S = 0.01
TERM_GRACE_S = 0.2
# After the shell exits, a background job may still hold the pipes open; read what is
# already there for this long, then stop listening.
DRAIN_GRACE_S = 0.2
READ_CHUNK = 65_536
# Room kept for the headers and truncation markers of `ProcessResult.summary`.
MARKER_RESERVE = 256
DEFAULT_SHELL = shutil.which("bash") or "/bin/sh"

StopCause = Literal["timeout", "cancelled"]


@dataclass(frozen=True)
class ProcessResult:
    """How a command ended. `exit_code` is negative (-signal) when a signal killed it."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    cancelled: bool
    duration_ms: int
    stdout_truncated_bytes: int
    stderr_truncated_bytes: int
    pid: int
    limit_note: str | None = None  # a limit of the call's (`limits`) stopped part of it

    def summary(self, max_bytes: int = 64_000) -> str:
        """`exit_code: N`, then the non-empty streams, sharing `max_bytes` between them."""
        lines = []
        if self.timed_out:
            lines.append(f"timed out after {self.duration_ms} ms; process group killed")
        if self.cancelled:
            lines.append(f"cancelled after {self.duration_ms} ms; process group killed")
        if self.limit_note:
            lines.append(self.limit_note)
        lines.append(f"exit_code: {self.exit_code}")
        streams = [self.stdout.encode(), self.stderr.encode()]
        allowed = fair_shares([len(data) for data in streams], max(0, max_bytes - MARKER_RESERVE))
        for name, data, keep, dropped in zip(
            ("stdout", "stderr"),
            streams,
            allowed,
            (self.stdout_truncated_bytes, self.stderr_truncated_bytes),
            strict=True,
        ):
            dropped += len(data) - keep
            if data:
                lines += [f"--- {name} ---", data[:keep].decode(errors="ignore").rstrip("\n")]
            if dropped:
                lines.append(f"[{name} truncated: {dropped} more bytes dropped]")
        return "\n".join(lines)


def fair_shares(sizes: list[int], budget: int) -> list[int]:
    """Split `budget` so small items keep everything and large ones share the rest evenly."""
    allowed = [0] * len(sizes)
    remaining = budget
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for done, index in enumerate(order):
        allowed[index] = min(sizes[index], remaining // (len(order) - done))
        remaining -= allowed[index]
    return allowed


class _Sink:
    """Keeps the first `cap` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = max(0, self.cap - len(self.data))
        self.data += chunk[:room]
        self.dropped += len(chunk) - min(room, len(chunk))

    def text(self) -> str:
        return bytes(self.data).decode("utf-8", errors="replace")


class _Pipes:
    """Both output pipes of one child behind one selector; reading never blocks the child."""

    def __init__(self, streams: tuple[IO[bytes], IO[bytes]], cap: int) -> None:
        self.stdout, self.stderr = _Sink(cap), _Sink(cap)
        self._selector = selectors.DefaultSelector()
        self._selector.register(streams[0], selectors.EVENT_READ, self.stdout)
        self._selector.register(streams[1], selectors.EVENT_READ, self.stderr)

    @property
    def is_open(self) -> bool:
        return bool(self._selector.get_map())

    def pump(self, timeout_s: float) -> None:
        """Read whatever arrives within `timeout_s`; past the cap the bytes are dropped."""
        if not self.is_open:
            time.sleep(max(0.0, timeout_s))
            return
        for key, _ in self._selector.select(max(0.0, timeout_s)):
            chunk = os.read(key.fd, READ_CHUNK)
            if chunk:
                key.data.add(chunk)
            else:
                self._selector.unregister(key.fileobj)

    def drain(self, grace_s: float) -> None:
        end = time.monotonic() + grace_s
        while self.is_open and (left := end - time.monotonic()) > 0:
            self.pump(left)

    def close(self) -> None:
        self._selector.close()


def run_command(
    command: str,
    *,
    timeout_s: float,
    cancelled: threading.Event | None = None,
    max_bytes: int = 64_000,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    shell: str = DEFAULT_SHELL,
    jail: Confinement | None = None,
) -> ProcessResult:
    """Run `command` with `shell -c` (inside `jail`'s sandbox when one is given); kill
    its process group on timeout or cancel."""
    argv = [shell, "-c", command]
    if jail is not None:
        argv, env = confined_argv(argv, jail, cwd or os.getcwd()), dict(jail.env)
    with _bounded(jail) as bound:
        spawn: dict[str, Any] = {"cwd": cwd, "env": env}
        if bound is not None:  # a hook switches user once it joined the call's cgroup
            argv = [*bound.prefix, *argv]
            spawn["preexec_fn"] = bound.hook
        elif jail is not None and jail.user:
            ids = ids_of(jail.user)  # the user's groups, never the worker's
            spawn.update(user=ids.uid, group=ids.gid, extra_groups=list(ids.groups))
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            **spawn,
        )
        result = _watch(proc, timeout_s, cancelled, max_bytes)
        note = bound.note(proc.returncode) if bound is not None else None
    return dataclasses.replace(result, limit_note=note) if note else result


@contextlib.contextmanager
def _bounded(jail: Confinement | None) -> Iterator[BoundCall | None]:
    """The call's bounds when it is sandboxed and its worker has some."""
    if jail is None or jail.bwrap is None or jail.bounds is None:
        yield None
        return
    ids = ids_of(jail.user) if jail.user else None
    with bound_call(jail.bounds, ids) as bound:
        yield bound


def _watch(
    proc: subprocess.Popen[bytes],
    timeout_s: float,
    cancelled: threading.Event | None,
    max_bytes: int,
) -> ProcessResult:
    """Read the child's output until it ends or must be stopped; kill its group then."""
    cancel = cancelled if cancelled is not None else threading.Event()
    started = time.monotonic()
    assert proc.stdout is not None and proc.stderr is not None
    pipes = _Pipes((proc.stdout, proc.stderr), max_bytes)
    try:
        cause = _supervise(proc, pipes, cancel, started + timeout_s)
        if cause is not None:
            _kill_group(proc, pipes)
        pipes.drain(DRAIN_GRACE_S)
    finally:
        pipes.close()
        proc.stdout.close()
        proc.stderr.close()
        if proc.poll() is None:  # an exception above: never leave the child behind
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    return ProcessResult(
        exit_code=proc.returncode,
        stdout=pipes.stdout.text(),
        stderr=pipes.stderr.text(),
        timed_out=cause == "timeout",
        cancelled=cause == "cancelled",
        duration_ms=int((time.monotonic() - started) * 1000),
        stdout_truncated_bytes=pipes.stdout.dropped,
        stderr_truncated_bytes=pipes.stderr.dropped,
        pid=proc.pid,
    )


def _supervise(
    proc: subprocess.Popen[bytes], pipes: _Pipes, cancel: threading.Event, deadline: float
) -> StopCause | None:
    """Read output until the child exits (None) or it must be stopped (the cause)."""
    while True:
        if cancel.is_set():
            return "cancelled"
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        if pipes.is_open:
            pipes.pump(min(POLL_S, left))
        else:  # both pipes closed: the child is ending, wait for it rather than sleep
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(min(POLL_S, left))
        if proc.poll() is not None:
            return None


def _kill_group(proc: subprocess.Popen[bytes], pipes: _Pipes) -> None:
    """SIGTERM the group, give it a moment, then SIGKILL whatever is left of it."""
    _signal_group(proc.pid, signal.SIGTERM)
    end = time.monotonic() + TERM_GRACE_S
    while proc.poll() is None and (left := end - time.monotonic()) > 0:
        pipes.pump(min(POLL_S, left))
    # Unconditional: the shell may be gone while a grandchild that ignores TERM lives on.
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
