"""The file tools' streaming and caps (`fileops`, `filesearch`), run in-process."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from cmdop_worker.machine import fileops, filesearch
from cmdop_worker.machine.fileops import Budget, Stopped, stream_lines
from cmdop_worker.machine.fileserver import dispatch


def budget(**kw: object) -> Budget:
    return Budget(time.monotonic() + 10, **kw)  # type: ignore[arg-type]


def lines_of(data: bytes, keep: int, tmp_path: Path, chunk: int = 4) -> list[tuple[bytes, bool]]:
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        old, fileops.CHUNK_BYTES = fileops.CHUNK_BYTES, chunk
        try:
            return list(stream_lines(fd, keep, budget()))
        finally:
            fileops.CHUNK_BYTES = old
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("data", "keep", "expected"),
    [
        (b"", 5, []),
        (b"ab\ncd", 5, [(b"ab", False), (b"cd", False)]),
        (b"ab\n\n", 5, [(b"ab", False), (b"", False)]),
        (b"abcdefgh\nxy\n", 3, [(b"abc", True), (b"xy", False)]),
        (b"abc\n", 3, [(b"abc", False)]),
        (b"abcdefghij", 3, [(b"abc", True)]),
        (b"abcd\nefghijkl\nm", 4, [(b"abcd", False), (b"efgh", True), (b"m", False)]),
    ],
)
def test_lines_stream_in_chunks_and_long_ones_are_cut(
    data: bytes, keep: int, expected: list[tuple[bytes, bool]], tmp_path: Path
) -> None:
    assert lines_of(data, keep, tmp_path) == expected


def test_a_long_single_line_is_shown_cut_and_the_next_line_still_numbered(tmp_path: Path) -> None:
    path = tmp_path / "long.txt"
    path.write_bytes(b"y" * 300_000 + b"\nshort\n")
    reply = fileops.read_file(str(path), 0, None, budget())
    first, second = reply.output.splitlines()
    assert first == "     1\t" + "y" * 2000 + " …[line truncated]"
    assert second == "     2\tshort"


def test_read_file_stops_at_the_byte_budget_and_says_where_to_go_on(tmp_path: Path) -> None:
    path = tmp_path / "many.txt"
    path.write_text("".join(f"{'z' * 90} {n}\n" for n in range(1, 1001)))
    reply = fileops.read_file(str(path), 0, None, budget(max_bytes=1_000))
    lines = reply.output.splitlines()
    assert lines[-1] == f"[more lines follow; continue with offset={len(lines) - 1}]"
    assert 10 <= len(lines) <= 12


def test_read_file_stops_when_cancelled(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    path.write_bytes(b"line\n" * 100_000)
    cancelled = threading.Event()
    cancelled.set()
    reply = fileops.read_file(
        str(path), 0, None, Budget(time.monotonic() + 10, 64_000, cancelled.is_set)
    )
    assert reply.status == "cancelled" and "stopped (cancelled)" in reply.output
    with pytest.raises(Stopped):
        fd = os.open(path, os.O_RDONLY)
        try:
            list(stream_lines(fd, 10, Budget(time.monotonic() - 1)))
        finally:
            os.close(fd)


@pytest.mark.parametrize("tool", ["read_file", "grep"])
def test_a_fifo_named_directly_is_refused_without_blocking(tool: str, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    args = {"path": str(fifo), "offset": 0, "limit": 10, "pattern": "x"}
    reply = dispatch(tool, args, budget())
    assert reply.status == "error" and "not a regular file" in reply.output


def test_grep_passes_over_a_fifo_and_a_socket_in_its_tree(tmp_path: Path) -> None:
    import socket

    os.mkfifo(tmp_path / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    (tmp_path / "a.txt").write_text("find me\n")
    try:
        reply = filesearch.grep("find", str(tmp_path), budget())
    finally:
        sock.close()
    assert (reply.status, reply.output) == ("ok", f"{tmp_path}/a.txt:1: find me")


def test_grep_reads_at_most_its_byte_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(filesearch, "GREP_MAX_BYTES", 100)
    (tmp_path / "a.txt").write_text("hit early\n" + "filler\n" * 50 + "hit late\n")
    (tmp_path / "b.txt").write_text("hit never\n")
    reply = filesearch.grep("hit", str(tmp_path), budget())
    assert reply.output.splitlines() == [
        f"{tmp_path}/a.txt:1: hit early",
        "[read limit 0 MiB reached; the rest was not searched]",
    ]


@pytest.mark.timeout(30)  # a hang guard: Python's `re` takes hours on this line
def test_grep_matches_a_backtracking_pattern_in_linear_time(tmp_path: Path) -> None:
    (tmp_path / "evil.txt").write_text("a" * 30 + "b\n" + "a" * 40 + "\n")
    reply = filesearch.grep("(a+)+$", str(tmp_path / "evil.txt"), budget())
    assert (reply.status, reply.output) == ("ok", f"{tmp_path}/evil.txt:2: {'a' * 40}")
    nested = filesearch.grep("(x+x+)+y", str(tmp_path), budget())
    assert (nested.status, nested.output) == ("ok", "no matches for '(x+x+)+y'")


@pytest.mark.parametrize(
    ("pattern", "unsupported"),
    [
        (r"(a)\1", r"invalid escape sequence: \1"),
        ("a(?=b)", "invalid perl operator: (?="),
        ("(?<!x)a", "invalid perl operator: (?<!"),
        ("(?P<n>a)(?P=n)", "invalid perl operator: (?P"),
    ],
)
def test_grep_names_what_re2_does_not_support(
    tmp_path: Path, pattern: str, unsupported: str
) -> None:
    (tmp_path / "a.txt").write_text("aa\n")
    reply = filesearch.grep(pattern, str(tmp_path), budget())
    assert reply.status == "invalid"
    assert reply.output == (
        f"invalid regex {pattern!r}: {unsupported} (grep uses RE2 syntax: no backreferences "
        "(\\1, (?P=name)) and no lookaround ((?=...), (?!...), (?<=...), (?<!...)))"
    )


def test_glob_does_not_list_through_a_link_out_of_its_tree(tmp_path: Path) -> None:
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "hostname").write_text("x")
    (tmp_path / "etc").symlink_to("/etc")
    (tmp_path / "inner").symlink_to(tmp_path / "own")  # a link that stays inside is fine
    found = filesearch.glob("*/hostname", str(tmp_path), budget()).output.splitlines()
    assert found == [f"{tmp_path}/inner/hostname", f"{tmp_path}/own/hostname"]


def test_write_file_content_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fileops, "WRITE_MAX_BYTES", 10)
    target = tmp_path / "out.txt"
    reply = dispatch("write_file", {"path": str(target), "content": "x" * 11}, budget())
    assert reply.status == "error"
    assert reply.output.startswith("ValueError: content is 11 bytes; write_file writes at most 10")
    assert not target.exists()
