"""What the file tools do to the filesystem: read, write and list, streamed and capped.

Every read goes through a handle opened without following links and without blocking
(`open_regular`): a FIFO, socket or device is refused before a byte is read, so a call
can never hang on one. Files are read in bounded chunks, never a whole line at a time:
a line longer than the cap is cut while it streams past, so a 512 MiB single-line file
costs one chunk of memory. Output stops at the call's byte budget with a note saying
how to page on.

Called by `fileserver.dispatch`, which runs inside the sandbox's file server (or in
the worker itself when the sandbox is off). Imports only the standard library and
`paths`, so the sandboxed server starts fast. Failures are exceptions; the dispatcher
turns them into the tool's error text.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cmdop_worker.machine.paths import open_dir_beneath, open_file_beneath, regular_only

DEFAULT_READ_LIMIT = 2_000
LINE_MAX_CHARS = 2_000
# A UTF-8 character is at most 4 bytes, so this many bytes always hold LINE_MAX_CHARS.
LINE_KEEP_BYTES = LINE_MAX_CHARS * 4
BINARY_SNIFF_BYTES = 8_192
CHUNK_BYTES = 65_536
MAX_DIR_ENTRIES = 1_000
WRITE_MAX_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class FileReply:
    """A file tool's answer: its text and its status ("ok", "error", "timeout", …)."""

    output: str
    status: str = "ok"


@dataclass(frozen=True)
class Budget:
    """How long a file call may run, how much it may answer, and whether to stop."""

    deadline_monotonic: float
    max_bytes: int = 64_000
    cancelled: Callable[[], bool] = field(default=lambda: False)

    def stop_reason(self) -> str | None:
        """ "cancelled" or "timeout" once the call must stop, else None."""
        if self.cancelled():
            return "cancelled"
        return "timeout" if time.monotonic() >= self.deadline_monotonic else None


class Stopped(Exception):
    """The call's deadline passed or its run was cancelled mid-read."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def expand_path(path: str) -> Path:
    return Path(os.path.expanduser(path))


def open_regular(path: str) -> int:
    """A read handle on the regular file `path`: no link followed on the last step, no
    blocking open, and a FIFO, socket, device or directory refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    return regular_only(fd, path)


def is_binary(fd: int) -> bool:
    """A NUL in the first 8 KiB (read in place: the handle's position is unchanged)."""
    return b"\x00" in os.pread(fd, BINARY_SNIFF_BYTES, 0)


def stream_lines(
    fd: int, keep_bytes: int, budget: Budget, max_read: int | None = None
) -> Iterator[tuple[bytes, bool]]:
    """Each line without its newline, cut to `keep_bytes`, and whether it was cut. Reads
    `CHUNK_BYTES` at a time (at most `max_read` bytes in all); what a long line holds
    past the cap is dropped as it passes."""
    kept = bytearray()
    cut = False
    left = max_read
    while chunk := os.read(fd, CHUNK_BYTES if left is None else min(CHUNK_BYTES, left)):
        if left is not None:
            left -= len(chunk)
        if (reason := budget.stop_reason()) is not None:
            raise Stopped(reason)
        start = 0
        while (newline := chunk.find(b"\n", start)) >= 0:
            room = keep_bytes - len(kept)
            kept += chunk[start : start + min(room, newline - start)]
            yield bytes(kept), cut or newline - start > room
            kept.clear()
            cut, start = False, newline + 1
        room = keep_bytes - len(kept)
        kept += chunk[start : start + room]
        cut = cut or len(chunk) - start > room
    if kept or cut:
        yield bytes(kept), cut


def shown_line(raw: bytes, cut: bool) -> str:
    line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    if cut or len(line) > LINE_MAX_CHARS:
        return line[:LINE_MAX_CHARS] + " …[line truncated]"
    return line


def read_file(path: str, offset: int, limit: int | None, budget: Budget) -> FileReply:
    """Lines numbered like `cat -n`, from line `offset + 1`, at most `limit` of them."""
    target = expand_path(path)
    fd = open_file_beneath(str(target))
    try:
        if is_binary(fd):
            size = os.fstat(fd).st_size
            return FileReply(f"binary file {target} ({size} bytes); content not shown")
        return FileReply(numbered_lines(fd, offset, limit, budget))
    except Stopped as stop:
        return FileReply(f"read_file stopped ({stop.reason}) while reading {target}", stop.reason)
    finally:
        os.close(fd)


def numbered_lines(fd: int, offset: int, limit: int | None, budget: Budget) -> str:
    shown: list[str] = []
    size = seen = 0
    for seen, (raw, cut) in enumerate(stream_lines(fd, LINE_KEEP_BYTES, budget), start=1):
        if seen <= offset:
            continue
        if (limit is not None and len(shown) >= limit) or size > budget.max_bytes:
            shown.append(f"[more lines follow; continue with offset={seen - 1}]")
            break
        shown.append(f"{seen:>6}\t{shown_line(raw, cut)}")
        size += len(shown[-1]) + 1
    if shown:
        return "\n".join(shown)
    return "(empty file)" if seen == 0 else f"(no lines after offset {offset}; {seen} lines)"


def write_file(path: str, content: str) -> FileReply:
    """Create or replace a file atomically (parent directories are created)."""
    data = content.encode("utf-8")
    check_write_size(len(data))
    target = expand_path(path)
    existed = target.exists()
    write_atomic(target, data)
    return FileReply(
        f"wrote {len(data)} bytes to {target} ({'replaced' if existed else 'created'})"
    )


def check_write_size(size: int) -> None:
    if size > WRITE_MAX_BYTES:
        raise ValueError(
            f"content is {size:,} bytes; write_file writes at most {WRITE_MAX_BYTES:,} bytes"
            " (8 MiB) per call"
        )


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


def list_dir(path: str) -> FileReply:
    """Sorted entries, directories end with `/`, files show their size."""
    target = expand_path(path)
    with os.scandir(target) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    lines = [f"{target} ({len(entries)} entries)"]
    lines += [dir_entry_line(entry) for entry in entries[:MAX_DIR_ENTRIES]]
    if len(entries) > MAX_DIR_ENTRIES:
        lines.append(f"[{len(entries) - MAX_DIR_ENTRIES} more entries not shown]")
    return FileReply("\n".join(lines))


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
