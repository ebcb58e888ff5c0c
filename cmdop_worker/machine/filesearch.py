"""The searching file tools: `grep` over a file or a tree, and `glob`.

Both stay in the tree they were given, since a rule granted that tree: a walk skips
links that lead out of it, and a glob drops what it found by passing through a linked
directory that leads out (`*/passwd` where a child is a link to `/etc`). Both skip
what the permission floor protects (`.git`, `.ssh`, `.env*`), so a recursive search
never reads secrets the floor would refuse to read one by one.

`grep` matches with RE2 (`linear`), in time linear in the text for any pattern: the
model writes the pattern, and a backtracking one such as `(a+)+$` would hold Python's
`re` on one line past the call's deadline. A pattern RE2 refuses (backreferences,
lookaround) is an `invalid` reply that says so.

`grep` reads only regular files, opened without blocking (a FIFO, socket or device in
the tree is passed over, never opened for a read that could hang), streams them in
chunks, matches each line in its first `GREP_LINE_BYTES`, and reads at most
`GREP_MAX_BYTES` per call. Both stop at the call's deadline or cancel with what they
found so far.

Called by `fileserver.dispatch` (inside the sandbox's file server, or in the worker
when the sandbox is off).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from cmdop_worker.machine.fileops import (
    LINE_MAX_CHARS,
    Budget,
    FileReply,
    Stopped,
    expand_path,
    is_binary,
    open_regular,
    stream_lines,
)
from cmdop_worker.machine.floor import protected_path_reason
from cmdop_worker.machine.linear import Linear, Unsupported

MAX_GREP_MATCHES = 500
GREP_LINE_BYTES = 65_536
GREP_MAX_BYTES = 256 * 1024 * 1024
MAX_GLOB_MATCHES = 1_000
GLOB_SCAN_LIMIT = 100_000
_STOP_NOTES = {"cancelled": "cancelled", "timeout": "stopped at the deadline"}
RE2_NOTE = (
    "grep uses RE2 syntax: no backreferences (\\1, (?P=name)) and no lookaround "
    "((?=...), (?!...), (?<=...), (?<!...))"
)


def grep(pattern: str, path: str, budget: Budget) -> FileReply:
    """`path:line: text` for each line matching the RE2 pattern; binary files skipped."""
    try:
        regex = Linear(pattern)
    except Unsupported as exc:
        return FileReply(f"invalid regex {pattern!r}: {exc} ({RE2_NOTE})", "invalid")
    root = expand_path(path)
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    search = Search(regex, budget)
    try:
        for shown, real in walk_files(root):
            if (reason := budget.stop_reason()) is not None:
                raise Stopped(reason)
            if not search.scan(shown, real):
                break
    except Stopped as stop:
        note = f"[grep {_STOP_NOTES[stop.reason]}]"
        return FileReply(search.render() + "\n" + note, stop.reason)
    return FileReply(search.render())


class Search:
    """Matches of one grep, capped at `max_matches` and at `GREP_MAX_BYTES` read."""

    def __init__(self, regex: Linear, budget: Budget, max_matches: int = MAX_GREP_MATCHES) -> None:
        self.regex, self.budget, self.max_matches = regex, budget, max_matches
        self.hits: list[str] = []
        self.unreadable = 0
        self.full = False
        self.read_bytes = 0
        self.out_of_bytes = False

    def scan(self, shown: str, real: str) -> bool:
        """Add the file's matches; False once a cap is reached."""
        try:
            fd = open_regular(real)
        except OSError:
            self.unreadable += 1
            return True
        try:
            return self._scan_open(fd, shown)
        except OSError:
            self.unreadable += 1
            return True
        finally:
            os.close(fd)

    def _scan_open(self, fd: int, shown: str) -> bool:
        allowed = GREP_MAX_BYTES - self.read_bytes
        if is_binary(fd):
            return True
        try:
            lines = stream_lines(fd, GREP_LINE_BYTES, self.budget, max_read=allowed)
            for number, (raw, _) in enumerate(lines, start=1):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if self.regex.search(line):
                    if len(self.hits) >= self.max_matches:
                        self.full = True
                        return False
                    self.hits.append(f"{shown}:{number}: {line[:LINE_MAX_CHARS]}")
        finally:
            # Counted as read, not by size: a /proc file says 0 bytes and has more.
            read = os.lseek(fd, 0, os.SEEK_CUR)
            self.read_bytes += read
        if read >= allowed:
            self.out_of_bytes = True
            return False
        return True

    def render(self) -> str:
        lines = self.hits or [f"no matches for {self.regex.pattern!r}"]
        if self.full:
            lines.append(f"[match limit {self.max_matches} reached; narrow the pattern or path]")
        if self.out_of_bytes:
            mib = GREP_MAX_BYTES // (1024 * 1024)
            lines.append(f"[read limit {mib} MiB reached; the rest was not searched]")
        if self.unreadable:
            lines.append(f"[{self.unreadable} unreadable files skipped]")
        return "\n".join(lines)


def walk_files(root: Path) -> Iterator[tuple[str, str]]:
    """(path as shown, its real path) of the file itself, or of every regular file under
    the directory in sorted order, minus the floor and minus links that lead out of
    the tree (the rule granted the tree). FIFOs, sockets and devices are passed over."""
    if not root.is_dir():
        if not stat.S_ISREG(os.stat(root).st_mode):
            raise OSError(f"not a regular file: {root}")
        yield str(root), str(root)
        return
    inside = os.path.realpath(root).rstrip("/") + "/"
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if protected_path_reason(d) is None)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            real = os.path.realpath(path)
            protected = protected_path_reason(name) or protected_path_reason(real)
            if real.startswith(inside) and protected is None and _is_regular(real):
                yield path, real


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True  # counted as unreadable when the open fails


def glob(pattern: str, path: str | None, budget: Budget) -> FileReply:
    """Paths matching a glob pattern (`**` matches any depth), sorted."""
    asked = pattern
    pattern = os.path.expanduser(pattern)
    base = expand_path(path or ".")
    if os.path.isabs(pattern):  # pathlib refuses absolute patterns: glob from the root
        base, pattern = Path("/"), pattern.lstrip("/")
    if not base.is_dir():
        raise NotADirectoryError(f"not a directory: {base}")
    matches, stopped = _matches(base, pattern, budget)
    lines = [str(p) + ("/" if p.is_dir() else "") for p in matches[:MAX_GLOB_MATCHES]]
    if len(matches) > MAX_GLOB_MATCHES:
        lines.append(f"[{len(matches) - MAX_GLOB_MATCHES} more matches not shown]")
    if stopped is not None:
        lines.append(f"[glob {_STOP_NOTES[stopped]}]")
        return FileReply("\n".join(lines), stopped)
    return FileReply("\n".join(lines) if lines else f"no paths match {asked!r} under {base}")


def _matches(base: Path, pattern: str, budget: Budget) -> tuple[list[Path], str | None]:
    """The sorted matches in the tree, and why the scan stopped early (None: it ended)."""
    inside = os.path.realpath(base).rstrip("/") + "/"
    found: list[Path] = []
    stopped = None
    for scanned, match in enumerate(base.glob(pattern)):
        if scanned >= GLOB_SCAN_LIMIT:
            break
        if scanned % 256 == 0 and (stopped := budget.stop_reason()) is not None:
            break
        if _in_tree(match, inside) and not _protected_match(match, base):
            found.append(match)
    return sorted(found), stopped


def _in_tree(match: Path, inside: str) -> bool:
    """Found by listing a directory of the tree: not through a link that leads out."""
    return (os.path.realpath(match.parent).rstrip("/") + "/").startswith(inside)


def _protected_match(path: Path, base: Path) -> bool:
    """A match behind the floor by its name, or by where its links lead."""
    rel = str(path.relative_to(base))
    return bool(protected_path_reason(rel) or protected_path_reason(os.path.realpath(path)))
