"""How much one sandboxed call may use, and how a call that went past it is told.

The policy's `[sandbox.limits]` table (`Limits`) bounds each call's processes (and
threads), memory, the size of any one file it writes, and its private `/tmp` and
`/run`. How a limit is held depends on what the machine allows (`cgroups`):

- processes and memory: a cgroup of the call's own (v1 `pids`/`memory` controllers,
  or v2), made when the call starts and removed after it; without one, memory falls
  back to `RLIMIT_DATA` (per process, not per call) and processes to `RLIMIT_NPROC`
  (per user, and the kernel does not apply it to root);
- file size: `RLIMIT_FSIZE`, always;
- `/tmp` and `/run`: the size of the sandbox's tmpfs (`bwrap --size`).

Pure: what to set (`rlimits_for`), what the start log says (`describe`), and the note a
result carries when a limit stopped the call (`overrun_note`). The I/O is in
`cgroups` and `process`.
"""

from __future__ import annotations

import resource
import signal
from dataclasses import dataclass

MIB = 1 << 20
# bwrap reports a child killed by a signal as 128 + the signal's number.
_SIGNAL_EXIT = 128


@dataclass(frozen=True)
class Limits:
    """Per call; 0 means no limit."""

    max_processes: int = 256
    max_memory_mb: int = 1024
    max_file_size_mb: int = 1024
    tmp_size_mb: int = 256

    @property
    def tmp_size_bytes(self) -> int:
        return self.tmp_size_mb * MIB


NO_LIMITS = Limits(0, 0, 0, 0)


@dataclass(frozen=True)
class Means:
    """What this machine can hold a call to, found once when the worker starts."""

    pids_cgroup: bool = False
    memory_cgroup: bool = False
    tmpfs_size: bool = False  # bwrap has --size
    tool_uid: int = 0  # whom tool processes run as: RLIMIT_NPROC means nothing for root
    shell: bool = False  # /bin/sh can take the bounds on before exec (`bounds`)


def rlimits_for(limits: Limits, means: Means) -> tuple[tuple[int, int], ...]:
    """(resource, value) pairs a call's first process sets, soft and hard alike, so no
    process in the call can raise them again."""
    out = []
    if limits.max_file_size_mb:
        out.append((resource.RLIMIT_FSIZE, limits.max_file_size_mb * MIB))
    if limits.max_memory_mb and not means.memory_cgroup:
        out.append((resource.RLIMIT_DATA, limits.max_memory_mb * MIB))
    if limits.max_processes and not means.pids_cgroup and means.tool_uid != 0:
        out.append((resource.RLIMIT_NPROC, limits.max_processes))
    return tuple(out)


def describe(limits: Limits, means: Means, cgroup_note: str) -> str:
    """One line for the start log: each limit, and how (or whether) it is held."""
    parts = [
        _held("processes", limits.max_processes, "", _processes_by(means, cgroup_note)),
        _held("memory", limits.max_memory_mb, " MiB", _memory_by(means, cgroup_note)),
        _held("file size", limits.max_file_size_mb, " MiB", "RLIMIT_FSIZE"),
        _held(
            "/tmp and /run",
            limits.tmp_size_mb,
            " MiB each",
            "tmpfs size" if means.tmpfs_size else "NOT held: this bwrap has no --size",
        ),
    ]
    return "tool call limits: " + "; ".join(parts)


def _held(name: str, value: int, unit: str, how: str) -> str:
    return f"{name} unlimited" if not value else f"{name} {value}{unit} ({how})"


def _processes_by(means: Means, cgroup_note: str) -> str:
    if means.pids_cgroup:
        return cgroup_note
    if means.tool_uid != 0:
        return "RLIMIT_NPROC, counted over all of the tool user's processes"
    return "NOT held: no pids cgroup, and RLIMIT_NPROC does not bind root"


def _memory_by(means: Means, cgroup_note: str) -> str:
    if means.memory_cgroup:
        return cgroup_note
    return "RLIMIT_DATA, per process"


@dataclass(frozen=True)
class Overrun:
    """What a call's cgroup counted: process creations refused, out-of-memory kills."""

    forks_refused: int = 0
    oom_kills: int = 0


def overrun_note(limits: Limits, exit_code: int, seen: Overrun) -> str | None:
    """The line a result carries when a limit stopped (part of) the call, else None."""
    notes = []
    if seen.oom_kills:
        notes.append(f"killed: memory limit {limits.max_memory_mb} MiB reached")
    if seen.forks_refused:
        notes.append(
            f"refused: process limit {limits.max_processes} reached "
            f"({seen.forks_refused} process creations failed)"
        )
    if limits.max_file_size_mb and exit_code in (
        -signal.SIGXFSZ,
        _SIGNAL_EXIT + signal.SIGXFSZ,
    ):
        notes.append(f"killed: file size limit {limits.max_file_size_mb} MiB reached")
    return "; ".join(notes) or None


NOGROUP_GID = 65534  # a uid with no passwd entry runs in the nogroup group


@dataclass(frozen=True)
class ToolIds:
    """Who a tool runs as: the user, its primary group and its own groups only, never
    the worker's (a root worker's group 0 would read every root:root 0640 file)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
