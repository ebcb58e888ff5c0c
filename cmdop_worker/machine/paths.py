"""The path a file tool will actually touch, worked out before any rule sees it.

Rules and the hard floor are matched on paths, so a path must be canonical first, or
`/var/log/../../etc/shadow` passes a `/var/log/*` rule and a symlink walks a write out
of its tree. `canonical_input` rewrites a file tool's arguments: `~` expanded, relative
paths joined to the working directory, `..` and `//` normalised, symlinks resolved.
The tool then runs on the rewritten arguments, so the path checked is the path used.

`write_file` is stricter: a final component that is a symlink is refused (a link is
where a write escapes the tree its rule granted). Between the check and the use there
is time (an approval can take a minute), so `read_file` and `write_file` open the
canonical path one component at a time without following links (`open_dir_beneath`):
a link swapped in meanwhile fails the call instead of redirecting it. For `glob`, the literal
head of the pattern joins the search root (`/etc/*` searches `/etc`) and `..` in a
pattern is refused, so the root a rule sees is the tree searched.

Called by the machine worker before the permission gate; the only I/O is reading the
filesystem (`realpath`, `lstat`).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
from collections.abc import Mapping
from typing import Any

PATH_TOOLS = frozenset({"read_file", "write_file", "list_dir", "grep"})
_GLOB_CHARS = frozenset("*?[")


class PathRefused(ValueError):
    """A file tool's path that no rule may be asked about."""


def canonical(path: str, cwd: str) -> str:
    """Absolute, normalised, every symlink resolved (missing tails kept as written)."""
    return os.path.realpath(os.path.join(cwd, os.path.expanduser(path)))


def canonical_input(tool: str, args: Mapping[str, Any], cwd: str) -> dict[str, Any]:
    """The call's arguments with its paths canonical; `PathRefused` says why not."""
    out = dict(args)
    if tool in PATH_TOOLS and isinstance(args.get("path"), str):
        raw = args["path"]
        out["path"] = _write_target(raw, cwd) if tool == "write_file" else canonical(raw, cwd)
    elif tool == "glob" and isinstance(args.get("pattern"), str):
        base = args.get("path")
        root = base if isinstance(base, str) else "."
        out["path"], out["pattern"] = glob_root(args["pattern"], root, cwd)
    return out


def _write_target(path: str, cwd: str) -> str:
    joined = posixpath.normpath(os.path.join(cwd, os.path.expanduser(path)))
    if os.path.islink(joined):
        raise PathRefused(f"{joined} is a symlink; write_file does not write through links")
    parent, name = posixpath.split(joined)
    return posixpath.join(os.path.realpath(parent), name)


def glob_root(pattern: str, base: str, cwd: str) -> tuple[str, str]:
    """(the canonical directory searched, the pattern relative to it)."""
    pattern = os.path.expanduser(pattern)
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathRefused(f"glob pattern {pattern!r} climbs with '..'; set `path` instead")
    head: list[str] = []
    for part in parts[:-1]:
        if _GLOB_CHARS.intersection(part):
            break
        head.append(part)
    start = "/" if pattern.startswith("/") else canonical(base, cwd)
    root = canonical(posixpath.join(start, *head), cwd)
    return root, "/".join(parts[len(head) :]) or "*"


def open_dir_beneath(path: str, *, create: bool = False) -> int:
    """A handle on the directory `path`, each component opened from `/` without following
    a link, so a symlink swapped in after the permission gate checked the path fails the
    open instead of redirecting it. `create` makes missing directories on the way."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        for part in [p for p in os.path.abspath(path).split("/") if p]:
            nxt = _open_component(fd, part, create)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_component(dir_fd: int, part: str, create: bool) -> int:
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        try:
            return os.open(part, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=dir_fd)
            return os.open(part, flags, dir_fd=dir_fd)
    except OSError as exc:
        if os.path.islink(f"/proc/self/fd/{dir_fd}/{part}"):
            raise PathRefused(f"{part} became a symlink after the permission check") from exc
        raise


def open_file_beneath(path: str) -> int:
    """The regular file `path` opened for reading through `open_dir_beneath`, never
    through a link; a directory, FIFO or device is refused without blocking."""
    head, name = posixpath.split(os.path.abspath(path))
    dir_fd = open_dir_beneath(head)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    return regular_only(fd, path)


def regular_only(fd: int, path: str) -> int:
    """`fd` when it is a regular file's; else it is closed and the kind refused."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = IsADirectoryError if stat.S_ISDIR(mode) else OSError
        raise kind(f"not a regular file: {path}")
    return fd
