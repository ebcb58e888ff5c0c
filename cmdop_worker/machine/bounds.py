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
import resource
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from cmdop_worker.machine.cgroups import CallCgroup, CgroupTree, open_cgroups, start_hook
from cmdop_worker.machine.limits import (
    MIB,
    NOGROUP_GID,
    Limits,
    Means,
    Overrun,
    ToolIds,
    describe,
    overrun_note,
    rlimits_for,
)

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
    """One call's bounds while it runs: how its first process takes them on (a `prefix`
    to its argv, else a pre-exec `hook`), and the note once it ended."""

    bounds: Bounds
    cgroup: CallCgroup | None
    prefix: tuple[str, ...] = ()
    hook: Callable[[], None] | None = None

    def note(self, exit_code: int) -> str | None:
        seen = self.cgroup.overrun() if self.cgroup is not None else Overrun()
        return overrun_note(self.bounds.limits, exit_code, seen)


@contextlib.contextmanager
def bound_call(bounds: Bounds, ids: ToolIds | None) -> Iterator[BoundCall]:
    """A call's cgroup made (when the worker has a tree) for as long as the call runs;
    the hook also switches to `ids`, after joining, which needs the worker's rights."""
    cgroup = CallCgroup(bounds.tree, bounds.limits) if bounds.tree is not None else None
    try:
        files = cgroup.procs_files if cgroup is not None else ()
        rlimits = rlimits_for(bounds.limits, bounds.means)
        prefix = shell_prefix(files, rlimits) if ids is None and bounds.means.shell else None
        if prefix is not None:
            yield BoundCall(bounds, cgroup, prefix=prefix)
        else:
            yield BoundCall(bounds, cgroup, hook=start_hook(files, rlimits, ids))
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
        shell=shell_sets_limits(),
        tool_uid=ids_of(tool_user).uid if tool_user else os.geteuid(),
    )
    summary = describe(limits, means, f"{tree.label} per call" if tree is not None else "")
    if tree is None and wants_cgroup:
        summary += f"; no cgroup of its own: {found}"
    return Bounds(limits, means, tree, summary)


# Joins the cgroups named, sets the limits, then execs the call: what a pre-exec hook
# would do, without one (a hook makes Python fork instead of vfork, which costs
# milliseconds per call in a worker of some size). `ulimit -f` counts 512-byte blocks
# and `-d` KiB in dash, bash as sh and busybox; `shell_sets_limits` checks that here.
SHELL = "/bin/sh"
_JOIN = """n=$1; shift
while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n - 1)); done
[ "$1" = - ] || ulimit -f "$1" || exit 125
[ "$2" = - ] || ulimit -d "$2" || exit 125
shift 2
exec "$@"
"""
_SHELL_UNITS = {resource.RLIMIT_FSIZE: 512, resource.RLIMIT_DATA: 1024}


def shell_prefix(
    procs_files: Sequence[str], rlimits: Sequence[tuple[int, int]]
) -> tuple[str, ...] | None:
    """The argv prefix that takes the call's bounds on; None when a limit needs the hook."""
    values = dict(rlimits)
    if set(values) - set(_SHELL_UNITS):
        return None
    args = [
        str(values[which] // unit) if which in values else "-"
        for which, unit in _SHELL_UNITS.items()
    ]
    return (SHELL, "-c", _JOIN, "sh", str(len(procs_files)), *procs_files, *args)


def shell_sets_limits() -> bool:
    """Whether this host's /bin/sh sets the limits `shell_prefix` asks, as asked."""
    wanted = {resource.RLIMIT_FSIZE: 3 * MIB, resource.RLIMIT_DATA: 3 * 1024 * MIB}
    prefix = shell_prefix((), tuple(wanted.items()))
    assert prefix is not None
    try:
        done = subprocess.run(
            [*prefix, "cat", "/proc/self/limits"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    shown = {
        "Max file size": str(wanted[resource.RLIMIT_FSIZE]),
        "Max data size": str(wanted[resource.RLIMIT_DATA]),
    }
    lines = done.stdout.splitlines()
    return all(
        any(line.startswith(name) and line.split()[3:5] == [value, value] for line in lines)
        for name, value in shown.items()
    )


def has_tmpfs_size(bwrap: str) -> bool:
    """Whether this bwrap can bound a tmpfs (`--size`)."""
    try:
        done = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    found = _VERSION.search(done.stdout)
    return found is not None and (int(found[1]), int(found[2])) >= SIZE_SINCE


def ids_of(user: str) -> ToolIds:
    """The tool user's ids; a bare number with no passwd entry gets the nobody group."""
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        if not user.isdigit():
            raise
        return ToolIds(int(user), NOGROUP_GID, (NOGROUP_GID,))
    groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return ToolIds(entry.pw_uid, entry.pw_gid, groups)
