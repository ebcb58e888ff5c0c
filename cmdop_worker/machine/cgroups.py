"""One cgroup per sandboxed call, holding its processes and memory to the policy's limits.

Found once when the worker starts (`open_cgroups`), in this order:

- cgroup v2, when the worker's own cgroup offers the `pids` and `memory` controllers
  and lets it delegate them (a root shell, a container's root, a systemd unit with
  `Delegate=yes`). A v2 cgroup that holds processes cannot hand controllers to
  children, so the worker first moves itself into a leaf of its own;
- cgroup v1, when the `pids` and `memory` hierarchies are mounted and writable;
- else nothing, and the start log says why (`limits.rlimits_for` falls back).

Each call (`CallCgroup`): `call-N` is made under the worker's directory with the
limits written; the call's first process joins it before exec (`bounds.shell_prefix`,
or the pre-exec hook `start_hook`), so nothing it forks escapes the count; after the
call its counters are read (`overrun`) and the cgroup removed (`cgroup_reaper`).
Used through `bounds`; the worker's side (`side`) opens the tree once.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import os
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cmdop_worker.machine.cgroup_reaper import reaper, remove_dirs, rmdir_once, sweep
from cmdop_worker.machine.limits import MIB, Limits, Overrun, ToolIds

CONTROLLERS = ("pids", "memory")
_names = itertools.count(1)


@dataclass(frozen=True)
class CgroupTree:
    """Where this worker makes its calls' cgroups: `{controller: directory}`; under v2
    both controllers name the same directory."""

    version: int
    bases: tuple[tuple[str, str], ...]

    @property
    def label(self) -> str:
        return f"cgroup v{self.version}"


def parse_own_cgroups(text: str) -> dict[str, str]:
    """`/proc/self/cgroup` as {controller: path}; the v2 line is under ""."""
    out = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def parse_cgroup_mounts(text: str) -> dict[str, str]:
    """`/proc/self/mounts` as {controller: mount point} for v1, {"": mount point} for v2."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        if fields[2] == "cgroup2":
            out.setdefault("", fields[1])
        elif fields[2] == "cgroup":
            for option in fields[3].split(","):
                out.setdefault(option, fields[1])
    return out


def open_cgroups(pid: int) -> CgroupTree | str:
    """This worker's cgroup tree, or why it has none."""
    try:
        own = parse_own_cgroups(_read("/proc/self/cgroup"))
        mounts = parse_cgroup_mounts(_read("/proc/self/mounts"))
    except OSError as exc:
        return f"cgroups unreadable: {exc}"
    v2_why = open_v2(own, mounts, pid)
    if isinstance(v2_why, CgroupTree):
        return v2_why
    if not all(c in mounts and c in own for c in CONTROLLERS):
        return f"{v2_why}; and no cgroup v1 pids and memory hierarchies"
    bases = []
    try:
        for controller in CONTROLLERS:
            parent = _join(mounts[controller], own[controller])
            sweep(parent)
            base = os.path.join(parent, f"cmdop-{pid}")
            os.makedirs(base, exist_ok=True)
            bases.append((controller, base))
    except OSError as exc:
        remove_dirs([base for _, base in bases])
        return f"{v2_why}; cgroup v1 not writable: {exc}"
    tree = CgroupTree(1, tuple(bases))
    atexit.register(remove_dirs, [base for _, base in bases])
    return tree


def open_v2(own: dict[str, str], mounts: dict[str, str], pid: int) -> CgroupTree | str:
    """The v2 directory this worker's calls go under (made, controllers delegated), or
    why there is none; `own` and `mounts` as `parse_own_cgroups`/`parse_cgroup_mounts`."""
    if "" not in mounts or "" not in own:
        return "no cgroup v2"
    mine = _join(mounts[""], own[""])
    try:
        offered = _read(os.path.join(mine, "cgroup.controllers")).split()
        if not set(CONTROLLERS) <= set(offered):
            return f"cgroup v2 at {mine} offers no {'/'.join(CONTROLLERS)} controllers"
        sweep(mine)
        if not _delegate(mine):  # it holds processes: move this worker to a leaf first
            leaf = os.path.join(mine, f"cmdop-worker-{pid}")
            os.makedirs(leaf, exist_ok=True)
            _write(os.path.join(leaf, "cgroup.procs"), str(pid))
            if not _delegate(mine):
                return f"cgroup v2 at {mine} holds other processes"
        calls = os.path.join(mine, f"cmdop-calls-{pid}")
        os.makedirs(calls, exist_ok=True)
        if not _delegate(calls):
            return f"cgroup v2 at {calls} cannot delegate"
    except OSError as exc:
        return f"cgroup v2 not writable: {exc}"
    atexit.register(remove_dirs, [calls])
    return CgroupTree(2, tuple((controller, calls) for controller in CONTROLLERS))


def _delegate(directory: str) -> bool:
    """Hand the controllers to `directory`'s children; False when it holds processes."""
    try:
        _write(os.path.join(directory, "cgroup.subtree_control"), "+pids +memory")
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return False
        raise
    return True


class CallCgroup:
    """The cgroup of one call: made with its limits, read, then removed."""

    def __init__(self, tree: CgroupTree, limits: Limits) -> None:
        self.version = tree.version
        name = f"call-{next(_names)}"
        self.dirs: dict[str, str] = {}
        wanted = {"pids": limits.max_processes, "memory": limits.max_memory_mb}
        distinct = {base: controller for controller, base in tree.bases if wanted[controller]}
        try:
            for base in distinct:
                directory = os.path.join(base, name)
                os.mkdir(directory)
                self.dirs[distinct[base]] = directory
            self._write_limits(limits)
        except OSError:
            self.remove()
            raise

    @property
    def procs_files(self) -> tuple[str, ...]:
        """Where the call's first process writes "0" to join. Under v1, `tasks`: a
        single thread moving itself skips the kernel's global thread-group lock, whose
        write side waits for an RCU grace period (milliseconds, and meanwhile every
        fork on the host is slowed); `cgroup.procs` always takes it."""
        name = "tasks" if self.version == 1 else "cgroup.procs"
        return tuple(os.path.join(d, name) for d in self.dirs.values())

    def _write_limits(self, limits: Limits) -> None:
        where = self.dirs.get("pids")
        if self.version == 2:  # one directory holds both controllers' files
            where = next(iter(self.dirs.values()), None)
        if limits.max_processes and where:
            _write(os.path.join(where, "pids.max"), str(limits.max_processes))
        if limits.max_memory_mb and where and self.version == 2:
            _write(os.path.join(where, "memory.max"), str(limits.max_memory_mb * MIB))
            _write_if_there(os.path.join(where, "memory.swap.max"), "0")
        memory = self.dirs.get("memory")
        if limits.max_memory_mb and memory and self.version == 1:
            _write(os.path.join(memory, "memory.limit_in_bytes"), str(limits.max_memory_mb * MIB))
            _write_if_there(
                os.path.join(memory, "memory.memsw.limit_in_bytes"), str(limits.max_memory_mb * MIB)
            )

    def overrun(self) -> Overrun:
        """What the kernel refused or killed in this call."""
        forks = oom = 0
        for directory in self.dirs.values():
            forks = max(forks, _counter(os.path.join(directory, "pids.events"), "max"))
            events = "memory.events" if self.version == 2 else "memory.oom_control"
            oom = max(oom, _counter(os.path.join(directory, events), "oom_kill"))
        return Overrun(forks_refused=forks, oom_kills=oom)

    def remove(self) -> None:
        """rmdir now; one whose processes are still exiting (the sandbox's init outlives
        bwrap's own exit by a moment) is left to a background thread, off the call's
        path."""
        busy = [d for d in self.dirs.values() if not rmdir_once(d)]
        if busy:
            reaper().put(busy)


def start_hook(
    procs_files: Sequence[str], rlimits: Sequence[tuple[int, int]], ids: ToolIds | None
) -> Callable[[], None]:
    """What the call's first process does between fork and exec: join its cgroup, set
    its limits, then (last: joining needs the worker's rights) become the tool user, its groups
    and only those.
    Only system calls here: it runs in a child of a threaded process."""

    def hook() -> None:
        me = b"0"  # itself; a forked child has a single thread
        for path in procs_files:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, me)
            finally:
                os.close(fd)
        for which, value in rlimits:
            hard = resource.getrlimit(which)[1]
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(which, (value, value))
        if ids is not None:  # groups first: once the uid is dropped they cannot be
            os.setgroups(ids.groups)
            os.setregid(ids.gid, ids.gid)
            os.setreuid(ids.uid, ids.uid)

    return hook


def _counter(path: str, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in _read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _join(mount: str, *parts: str) -> str:
    return os.path.join(mount, *(part.strip("/") for part in parts if part.strip("/")))


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _write_if_there(path: str, value: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _write(path, value)
