"""Removing the cgroups of calls that ended: at once, in the background while the
sandbox's last processes exit, and those a worker that died left behind (`sweep`).

Used by `cgroups`; touches only directories under the worker's own cgroup parents.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence

_REMOVE_TRIES = 50
_REMOVE_PAUSE_S = 0.01
_OWNED = re.compile(r"cmdop-(?:calls-|worker-)?(\d+)")  # made by the worker of that pid


def rmdir_once(directory: str) -> bool:
    """False while processes are still in it; any other failure is not retried (an
    empty cgroup left behind costs nothing, and the next worker sweeps it)."""
    try:
        os.rmdir(directory)
    except OSError as exc:
        return exc.errno != errno.EBUSY
    return True


@functools.cache
def reaper() -> queue.SimpleQueue[list[str]]:
    """A queue of busy cgroups and the one daemon thread that removes them."""
    todo: queue.SimpleQueue[list[str]] = queue.SimpleQueue()

    def work() -> None:
        while True:
            remove_dirs(todo.get())

    threading.Thread(target=work, name="cmdop-cgroup-reaper", daemon=True).start()
    return todo


def remove_dirs(dirs: Sequence[str]) -> None:
    """rmdir each cgroup; one still holding processes has them killed first."""
    for directory in dirs:
        for _ in range(_REMOVE_TRIES):
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    break
                _kill_all(directory)
                time.sleep(_REMOVE_PAUSE_S)


def sweep(parent: str) -> None:
    """Remove what workers that died without cleaning up left in `parent`."""
    for path in _subdirs(parent):
        owner = _OWNED.fullmatch(os.path.basename(path))
        if owner is not None and not _alive(int(owner[1])):
            remove_dirs([*_subdirs(path), path])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_all(directory: str) -> None:
    with contextlib.suppress(OSError):
        for line in _read(os.path.join(directory, "cgroup.procs")).split():
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(int(line), signal.SIGKILL)
    for child in _subdirs(directory):
        remove_dirs([child])


def _subdirs(directory: str) -> Iterator[str]:
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        yield from [entry.path for entry in entries if entry.is_dir(follow_symlinks=False)]


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()
