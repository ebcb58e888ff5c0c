"""The built-in tools every machine offers: a shell command and the file tools.

`register_builtins(registry)` adds them; `registry.default_registry()` calls it once
for the process-wide registry. Each tool's input model forbids unknown keys (the
registry strips the `machine` routing key first). Paths expand `~`; relative paths
are relative to the worker's working directory.

Tools that walk a tree (grep, glob) skip what the permission floor protects (`.git`,
`.ssh`, `.env*`), so a recursive search never reads secrets the floor would refuse
to read one by one. Permission decisions themselves are made before `run`, not here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict, Field

from cmdop_worker.core.routing import clamp_timeout_ms
from cmdop_worker.machine.floor import protected_path_reason
from cmdop_worker.machine.paths import open_dir_beneath, open_file_beneath
from cmdop_worker.machine.process import ProcessResult, run_command
from cmdop_worker.machine.toolbox import ToolContext, ToolRegistry, ToolReply
from cmdop_worker.models import ToolStatus

DEFAULT_TIMEOUT_MS = 120_000
DEFAULT_READ_LIMIT = 2_000
LINE_MAX_CHARS = 2_000
BINARY_SNIFF_BYTES = 8_192
MAX_DIR_ENTRIES = 1_000
MAX_GREP_MATCHES = 500
MAX_GLOB_MATCHES = 1_000
GLOB_SCAN_LIMIT = 100_000


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExecuteCommandArgs(_Args):
    command: str = Field(min_length=1, description="Shell command line (run with `bash -c`).")
    timeout_ms: int | None = Field(
        default=None, description="Kill the command after this many ms (1-600000, default 120000)."
    )


class ReadFileArgs(_Args):
    path: str = Field(min_length=1, description="File to read; `~` expands.")
    offset: int = Field(default=0, ge=0, description="Number of lines to skip.")
    limit: int | None = Field(default=DEFAULT_READ_LIMIT, ge=1, description="Lines to show.")


class WriteFileArgs(_Args):
    path: str = Field(min_length=1, description="File to create or replace.")
    content: str = Field(description="The whole new content (UTF-8).")


class ListDirArgs(_Args):
    path: str = Field(min_length=1, description="Directory to list.")


class GrepArgs(_Args):
    pattern: str = Field(min_length=1, description="Python regular expression.")
    path: str = Field(min_length=1, description="File, or directory searched recursively.")


class GlobArgs(_Args):
    pattern: str = Field(min_length=1, description="Glob such as `**/*.py` (`**` recurses).")
    path: str | None = Field(default=None, description="Base directory (default: cwd).")


def register_builtins(registry: ToolRegistry) -> ToolRegistry:
    registry.tool(tags=("system",), core=True)(execute_command)
    registry.tool(tags=("fileread",), core=True)(read_file)
    registry.tool(tags=("system",))(write_file)
    registry.tool(tags=("fileread",))(list_dir)
    registry.tool(tags=("fileread",))(grep)
    registry.tool(tags=("fileread",))(glob)
    return registry


def expand_path(path: str) -> Path:
    return Path(os.path.expanduser(path))


def execute_command(args: ExecuteCommandArgs, ctx: ToolContext) -> ToolReply:
    """Run a shell command on the machine; returns its exit code, stdout and stderr."""
    timeout_s = command_timeout_s(args.timeout_ms, ctx.remaining_s())
    result = run_command(
        args.command,
        timeout_s=timeout_s,
        cancelled=ctx.cancelled,
        max_bytes=ctx.output_max_bytes,
        cwd=ctx.cwd,
        jail=ctx.jail,
    )
    return ToolReply(result.summary(ctx.output_max_bytes), command_status(result))


def command_timeout_s(timeout_ms: int | None, remaining_s: float) -> float:
    """The asked timeout clamped to [1 ms, 600 s] (default 120 s), never past the deadline."""
    clamped_ms = clamp_timeout_ms(timeout_ms, DEFAULT_TIMEOUT_MS)
    return max(0.001, min(clamped_ms / 1000, remaining_s))


def command_status(result: ProcessResult) -> ToolStatus:
    if result.cancelled:
        return "cancelled"
    if result.timed_out:
        return "timeout"
    return "ok" if result.exit_code == 0 else "error"


def read_file(args: ReadFileArgs, ctx: ToolContext) -> str:
    """Read a text file; lines are numbered like `cat -n`. Use offset/limit to page."""
    path = expand_path(args.path)
    with os.fdopen(open_file_beneath(str(path)), "rb") as fh:
        if is_binary(fh):
            return f"binary file {path} ({os.fstat(fh.fileno()).st_size} bytes); content not shown"
        return numbered_lines(fh, args.offset, args.limit)


def is_binary(fh: IO[bytes]) -> bool:
    """A NUL in the first 8 KiB; leaves the file positioned at its start."""
    head = fh.read(BINARY_SNIFF_BYTES)
    fh.seek(0)
    return b"\x00" in head


def numbered_lines(fh: IO[bytes], offset: int, limit: int | None) -> str:
    shown: list[str] = []
    seen = 0
    for seen, raw in enumerate(fh, start=1):
        if seen <= offset:
            continue
        if limit is not None and len(shown) >= limit:
            shown.append(f"[more lines follow; continue with offset={offset + limit}]")
            break
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if len(line) > LINE_MAX_CHARS:
            line = line[:LINE_MAX_CHARS] + " …[line truncated]"
        shown.append(f"{seen:>6}\t{line}")
    if shown:
        return "\n".join(shown)
    return "(empty file)" if seen == 0 else f"(no lines after offset {offset}; {seen} lines)"


def write_file(args: WriteFileArgs, ctx: ToolContext) -> str:
    """Create or replace a file atomically (parent directories are created)."""
    path = expand_path(args.path)
    data = args.content.encode("utf-8")
    existed = path.exists()
    write_atomic(path, data)
    return f"wrote {len(data)} bytes to {path} ({'replaced' if existed else 'created'})"


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, rename: readers see old or new, never half.

    The directory is opened from `/` without following links, every step goes through
    that handle, and a final component that is a symlink is refused: the file written
    is in the directory the permission gate checked, even if a link is swapped in
    meanwhile. Set-user and set-group bits of a replaced file are not carried over."""
    dir_fd = open_dir_beneath(str(path.parent), create=True)
    try:
        _replace_in(dir_fd, path.name, data)
    finally:
        os.close(dir_fd)


def _replace_in(dir_fd: int, name: str, data: bytes) -> None:
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            raise PermissionError(f"{name} is a symlink; write_file does not write through it")
        mode = info.st_mode & 0o1777
    except FileNotFoundError:
        mode = 0o666 & ~current_umask()
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode, dir_fd=dir_fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def current_umask() -> int:
    # Read, not set-and-restore: os.umask() would race with other tool threads.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def list_dir(args: ListDirArgs, ctx: ToolContext) -> str:
    """List a directory: sorted entries, directories end with `/`, files show their size."""
    path = expand_path(args.path)
    with os.scandir(path) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    lines = [f"{path} ({len(entries)} entries)"]
    lines += [dir_entry_line(entry) for entry in entries[:MAX_DIR_ENTRIES]]
    if len(entries) > MAX_DIR_ENTRIES:
        lines.append(f"[{len(entries) - MAX_DIR_ENTRIES} more entries not shown]")
    return "\n".join(lines)


def dir_entry_line(entry: os.DirEntry[str]) -> str:
    try:
        if entry.is_dir():
            size, name = "-", entry.name + "/"
        else:
            size, name = str(entry.stat().st_size), entry.name
    except OSError:  # a dangling symlink
        size, name = "?", entry.name
    if entry.is_symlink():
        name += f" -> {os.readlink(entry.path)}"
    return f"{size:>12}  {name}"


def grep(args: GrepArgs, ctx: ToolContext) -> ToolReply:
    """Search files for a Python regex; prints `path:line: text`. Skips binary files."""
    try:
        regex = re.compile(args.pattern)
    except re.error as exc:
        return ToolReply(f"invalid regex {args.pattern!r}: {exc}", "invalid")
    root = expand_path(args.path)
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    search = Search(regex)
    for file in walk_files(root):
        if ctx.cancelled.is_set():
            return ToolReply(search.render() + "\n[grep cancelled]", "cancelled")
        if ctx.remaining_s() <= 0:
            return ToolReply(search.render() + "\n[grep stopped at the deadline]", "timeout")
        if not search.scan(file):
            break
    return ToolReply(search.render())


class Search:
    """Matches of one grep, capped at `max_matches`."""

    def __init__(self, regex: re.Pattern[str], max_matches: int = MAX_GREP_MATCHES) -> None:
        self.regex, self.max_matches = regex, max_matches
        self.hits: list[str] = []
        self.unreadable = 0
        self.full = False

    def scan(self, file: str) -> bool:
        """Add the file's matches; False once the cap is reached."""
        try:
            with open(file, "rb") as fh:
                if is_binary(fh):
                    return True
                for number, raw in enumerate(fh, start=1):
                    line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                    if self.regex.search(line):
                        if len(self.hits) >= self.max_matches:
                            self.full = True
                            return False
                        self.hits.append(f"{file}:{number}: {line[:LINE_MAX_CHARS]}")
        except OSError:
            self.unreadable += 1
        return True

    def render(self) -> str:
        lines = self.hits or [f"no matches for {self.regex.pattern!r}"]
        if self.full:
            lines.append(f"[match limit {self.max_matches} reached; narrow the pattern or path]")
        if self.unreadable:
            lines.append(f"[{self.unreadable} unreadable files skipped]")
        return "\n".join(lines)


def walk_files(root: Path) -> Iterator[str]:
    """The file itself, or every file under the directory in sorted order, minus the
    floor and minus links that lead out of the tree (the rule granted the tree)."""
    if not root.is_dir():
        yield str(root)
        return
    inside = os.path.realpath(root).rstrip("/") + "/"
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if protected_path_reason(d) is None)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            real = os.path.realpath(path)
            protected = protected_path_reason(name) or protected_path_reason(real)
            if real.startswith(inside) and protected is None:
                yield path


def _protected_match(path: Path, base: Path) -> bool:
    """A match behind the floor by its name, or by where its links lead."""
    rel = str(path.relative_to(base))
    return bool(protected_path_reason(rel) or protected_path_reason(os.path.realpath(path)))


def glob(args: GlobArgs, ctx: ToolContext) -> str:
    """Find paths matching a glob pattern (`**` matches any depth); sorted."""
    pattern = os.path.expanduser(args.pattern)
    base = expand_path(args.path or ".")
    if os.path.isabs(pattern):  # pathlib refuses absolute patterns: glob from the root
        base, pattern = Path("/"), pattern.lstrip("/")
    if not base.is_dir():
        raise NotADirectoryError(f"not a directory: {base}")
    found = itertools.islice(base.glob(pattern), GLOB_SCAN_LIMIT)
    matches = sorted(p for p in found if not _protected_match(p, base))
    lines = [str(p) + ("/" if p.is_dir() else "") for p in matches[:MAX_GLOB_MATCHES]]
    if len(matches) > MAX_GLOB_MATCHES:
        lines.append(f"[{len(matches) - MAX_GLOB_MATCHES} more matches not shown]")
    return "\n".join(lines) if lines else f"no paths match {args.pattern!r} under {base}"
