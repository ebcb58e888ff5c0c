"""Bounded work: each sandboxed call held to the policy's limits, with what this machine has.

`open_bounds` runs once when the worker starts: it finds the means (a cgroup tree of
the worker's own, a bwrap with `--size`, the tool user's uid) and sums up, for the
start log, which limit is held and how. `bound_call` wraps one call's process: its cgroup for as
long as it runs, the pre-exec hook that joins it and sets the rlimits, and the note a
result carries when a limit stopped the call. Used by `process.run_command` through
the call's `sandbox.Confinement`; the decisions are in `limits`, the cgroup files in
`cgroups`.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cmdop_worker.machine.cgroups import CallCgroup, CgroupTree, open_cgroups, start_hook
from cmdop_worker.machine.limits import Limits, Means, Overrun, describe, overrun_note, rlimits_for

# bwrap learned `--size` (bounding a --tmpfs) in 0.10.0.
SIZE_SINCE = (0, 10)
_VERSION = re.compile(r"(\d+)\.(\d+)")


@dataclass(frozen=True)
class Bounds:
    """The limits of every call of this worker, and the means found to hold them."""

    limits: Limits
    means: Means
    tree: CgroupTree | None = None
    summary: str = ""  # for the start log: each limit, and how it is held


@dataclass
class BoundCall:
    """One call's bounds while it runs: the pre-exec hook, and the note once it ended."""

    bounds: Bounds
    cgroup: CallCgroup | None
    hook: Callable[[], None]

    def note(self, exit_code: int) -> str | None:
        seen = self.cgroup.overrun() if self.cgroup is not None else Overrun()
        return overrun_note(self.bounds.limits, exit_code, seen)


@contextlib.contextmanager
def bound_call(bounds: Bounds, uid: int | None) -> Iterator[BoundCall]:
    """A call's cgroup made (when the worker has a tree) for as long as the call runs;
    the hook also switches to `uid`, after joining, which needs the worker's rights."""
    cgroup = CallCgroup(bounds.tree, bounds.limits) if bounds.tree is not None else None
    try:
        files = cgroup.procs_files if cgroup is not None else ()
        hook = start_hook(files, rlimits_for(bounds.limits, bounds.means), uid)
        yield BoundCall(bounds, cgroup, hook)
    finally:
        if cgroup is not None:
            cgroup.remove()


def open_bounds(limits: Limits, bwrap: str, tool_user: str | None) -> Bounds:
    """The means this worker has, found and logged once."""
    wants_cgroup = bool(limits.max_processes or limits.max_memory_mb)
    found = open_cgroups(os.getpid()) if wants_cgroup else "no limit needs one"
    tree = found if isinstance(found, CgroupTree) else None
    means = Means(
        pids_cgroup=tree is not None and bool(limits.max_processes),
        memory_cgroup=tree is not None and bool(limits.max_memory_mb),
        tmpfs_size=has_tmpfs_size(bwrap),
        tool_uid=uid_of(tool_user) if tool_user else os.geteuid(),
    )
    summary = describe(limits, means, f"{tree.label} per call" if tree is not None else "")
    if tree is None and wants_cgroup:
        summary += f"; no cgroup of its own: {found}"
    return Bounds(limits, means, tree, summary)


def has_tmpfs_size(bwrap: str) -> bool:
    """Whether this bwrap can bound a tmpfs (`--size`)."""
    try:
        done = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    found = _VERSION.search(done.stdout)
    return found is not None and (int(found[1]), int(found[2])) >= SIZE_SINCE


def uid_of(user: str) -> int:
    """A user name's (or a number's) uid."""
    if user.isdigit():
        return int(user)
    return pwd.getpwnam(user).pw_uid
