"""The floor, held by the operating system inside the sandbox.

The gate's floor (`floor`) reads command text, so `python3 -c "open('.'+'env')"`
passes it. Inside the sandbox these are mounted over, whatever a command types:

- every home's `.ssh` (`$HOME`, `/root` and each `/home/*`): an empty, read-only
  tmpfs with mode 000;
- `.env` and `.env.*` (but `.env.example`, `.sample`, `.template`, `.dist`: templates
  projects commit) directly in the working directory, in each writable grant and in
  each home: the blank, an empty file with mode 000 (uid 0 without capabilities is
  refused it too) — for a directory, the empty tmpfs;
- the worker's audit log (`own_files`): the blank;
- the unix sockets the fleet's URLs name (Redis at `unix:///srv/redis/redis.sock`,
  `sockets`), which a tool could connect to whatever its network: the socket's
  directory gets the empty tmpfs, so a Redis that restarts and makes its socket anew
  during a call makes it out of sight; where that directory holds what the call was
  given (its working directory, a grant, a reachable path, its home) or is a
  top-level one, the socket itself gets the blank (connecting to it is refused);
- `.git/config` and `.git/hooks` under a writable working directory or grant,
  `/etc/shadow`, `/etc/gshadow` and the worker's policy (`kept`): read-only even where
  a grant makes them writable (what a command writes there would run code, change a
  password or widen the policy, later).

Shallow on purpose, so a call costs a few directory listings: a `.env` deeper in a
tree is kept out only by the gate's text matching. `floor_args` reads the
filesystem (which of those exist, now); `sandbox.confined_argv` places its mounts
after the grants, so a grant cannot uncover them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import posixpath
import tempfile
from collections.abc import Iterator, Sequence

from cmdop_worker.machine.limits import ToolIds

HOMES_ROOT = "/home"
ROOT_HOME = "/root"
KEPT_READ_ONLY = ("/etc/shadow", "/etc/gshadow")
GIT_CODE_PATHS = (".git/config", ".git/hooks")
# `.env.example` and its kin hold names, not secrets, and are tracked by git: masked,
# they would show as changed in every `git status`.
TEMPLATE_SUFFIXES = frozenset({"example", "sample", "template", "dist"})
# A directory with more entries than this is only partly searched for `.env` files.
SCAN_LIMIT = 4096


def is_env_name(name: str) -> bool:
    """`.env` and `.env.*`, but for the templates projects commit to be read."""
    if name.startswith(".env.") and name[5:] in TEMPLATE_SUFFIXES:
        return False
    return name == ".env" or name.startswith(".env.")


def floor_args(
    cwd: str,
    grants: Sequence[str],
    visible: Sequence[str],
    home: str | None,
    own_files: Sequence[str],
    blank: str,
    ids: ToolIds | None = None,
    kept: Sequence[str] = (),
    sockets: Sequence[str] = (),
) -> list[str]:
    """bwrap mounts hiding the floor's paths that exist now; `visible` are the host
    paths the sandbox shows under its private trees (a path elsewhere is always shown);
    `ids` are the tool user's (None: the tool runs as the worker)."""
    mounts: list[tuple[str, list[str]]] = []
    for directory in homes(home):
        ssh = posixpath.join(directory, ".ssh")
        if os.path.isdir(ssh) and not os.path.islink(ssh):
            mounts.append((ssh, _empty_dir(ssh)))
    places = dict.fromkeys([cwd, *(g for g in grants if g != "/"), *homes(home)])
    for place in places:
        for path, is_dir in env_files(place):
            mounts.append((path, _empty_dir(path) if is_dir else ["--ro-bind", blank, path]))
    mounts += [(p, ["--ro-bind", blank, p]) for p in own_files if os.path.isfile(p)]
    given = [cwd, *grants, *visible, *homes(home)]
    mounts += [socket_mount(p, given, blank) for p in sockets if os.path.lexists(p)]
    writable = [p for p in (cwd, *grants) if any(_covers(g, p) for g in grants)]
    git = [posixpath.join(p, rel) for p in dict.fromkeys(writable) for rel in GIT_CODE_PATHS]
    for path in [*git, *kept, *KEPT_READ_ONLY]:
        if any(_covers(g, path) for g in grants) and os.path.lexists(path):
            mounts.append((path, ["--ro-bind", path, path]))
    # A path under a private /tmp or /run that the sandbox does not show is hidden
    # already, and bwrap would have to make its mount point.
    shown = [(target, args) for target, args in mounts if _shown(target, visible)]
    # bwrap runs as the tool user: it cannot mount where that user cannot reach (nor
    # could a tool of that user read what is there).
    return [arg for target, args in shown if searchable(target, ids) for arg in args]


def socket_mount(path: str, given: Sequence[str], blank: str) -> tuple[str, list[str]]:
    """Where and how one of the fleet's unix sockets is hidden (see the docstring)."""
    directory = posixpath.dirname(path)
    top_level = posixpath.dirname(directory) == "/"
    if top_level or any(_covers(directory, g) for g in given):
        return path, ["--ro-bind", blank, path]
    return directory, _empty_dir(directory)


def homes(home: str | None) -> list[str]:
    """The tool's home, root's, and each directory under /home."""
    found = [home] if home else []
    found.append(ROOT_HOME)
    try:
        with os.scandir(HOMES_ROOT) as entries:
            found += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        pass
    return list(dict.fromkeys(posixpath.normpath(p) for p in found))


def env_files(directory: str) -> Iterator[tuple[str, bool]]:
    """`.env` / `.env.*` entries directly in `directory` (symlinks are skipped: binding
    over one would hide its target instead): (path, is a directory)."""
    try:
        with os.scandir(directory) as entries:
            for seen, entry in enumerate(entries):
                if seen >= SCAN_LIMIT:
                    return
                if not is_env_name(entry.name) or entry.is_symlink():
                    continue
                yield entry.path, entry.is_dir(follow_symlinks=False)
    except OSError:
        return


def searchable(path: str, ids: ToolIds | None) -> bool:
    """Whether the tool user may walk to `path`: search rights on every directory above
    it, with that user's own groups (the tool runs with those, never the worker's)."""
    if ids is None or not ids.uid:
        return True
    uid, groups = ids.uid, {ids.gid, *ids.groups}
    parent = posixpath.dirname(path)
    while True:
        try:
            info = os.stat(parent)
        except OSError:
            return False
        if not info.st_mode & _search_bit(info, uid, groups):
            return False
        if parent == "/":
            return True
        parent = posixpath.dirname(parent)


def _search_bit(info: os.stat_result, uid: int, groups: set[int]) -> int:
    """The owner's, else the group's, else the others' search bit: only one applies."""
    if info.st_uid == uid:
        return 0o100
    return 0o010 if info.st_gid in groups else 0o001


def _empty_dir(path: str) -> list[str]:
    return ["--perms", "0000", "--tmpfs", path, "--remount-ro", path]


PRIVATE_TREES = ("/tmp", "/run")


def _shown(path: str, visible: Sequence[str]) -> bool:
    private = [t for t in PRIVATE_TREES if _covers(t, path)]
    return not private or any(_covers(v, path) for v in visible)


def _covers(granted: str, path: str) -> bool:
    granted = granted.rstrip("/")
    return not granted or path == granted or path.startswith(granted + "/")


def make_blank() -> str:
    """An empty file with mode 000, for the floor's files to be replaced by: reading it
    fails (no process in the sandbox has the capability to override its mode)."""
    fd, path = tempfile.mkstemp(prefix="cmdop-blank-")
    os.close(fd)
    os.chmod(path, 0)
    atexit.register(_remove_quietly, path)
    return path


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
