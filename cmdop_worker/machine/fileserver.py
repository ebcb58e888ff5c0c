"""The file tools' server, run inside a call's sandbox: one JSON line in, one line out.

    python -I -m cmdop_worker.machine.fileserver [--memory-mb N --file-mb N]
        [--uid N --gid N --groups N,N]

started by `filejail` inside bubblewrap with the call's confinement, so `read_file`,
`write_file`, `list_dir`, `grep` and `glob` see and may change exactly what
`execute_command` would: the read-only root, the writable grants, the private `/tmp`
and `/run`. The protocol, on stdin and stdout:

    -> {"ready": PID}                                   once, when it can serve
    <- {"tool": "read_file", "args": {...}, "remaining_s": 9.5, "max_bytes": 64000}
    -> {"output": "...", "status": "ok"}

One request at a time, in order; the server ends at end of input. It never stops a
call on its own but for the deadline it is given: a cancel kills it. `dispatch` is
also what the worker runs in-process when the sandbox is off, so both paths answer
with the same words. `serve` is the loop; `toolserve` serves user tools with it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from cmdop_worker.machine.fileops import (
    WRITE_MAX_BYTES,
    Budget,
    FileReply,
    list_dir,
    read_file,
    write_file,
)
from cmdop_worker.machine.filesearch import glob, grep

FILE_TOOLS = frozenset({"read_file", "write_file", "list_dir", "grep", "glob"})
# JSON escapes a character in at most 12 bytes (a surrogate pair as two `\uXXXX`),
# ASCII text in at most 6 (`\u0001`): room for the largest write_file's content.
MAX_REQUEST_BYTES = 6 * WRITE_MAX_BYTES + 65_536


def dispatch(tool: str, args: Mapping[str, Any], budget: Budget) -> FileReply:
    """Run one file tool on validated arguments; a failure is the tool's error text."""
    try:
        return _call(tool, args, budget)
    except Exception as exc:  # a tool failure is data for the model, not a crash
        return FileReply(f"{type(exc).__name__}: {exc}", "error")


def _call(tool: str, args: Mapping[str, Any], budget: Budget) -> FileReply:
    if tool == "read_file":
        return read_file(args["path"], args["offset"], args["limit"], budget)
    if tool == "write_file":
        return write_file(args["path"], args["content"])
    if tool == "list_dir":
        return list_dir(args["path"])
    if tool == "grep":
        return grep(args["pattern"], args["path"], budget)
    if tool == "glob":
        return glob(args["pattern"], args.get("path"), budget)
    raise ValueError(f"not a file tool: {tool!r}")


def encode_request(tool: str, args: Mapping[str, Any], remaining_s: float, max_bytes: int) -> bytes:
    """One request line. ASCII-escaped so names that are not UTF-8 travel intact."""
    body = {"tool": tool, "args": dict(args), "remaining_s": remaining_s, "max_bytes": max_bytes}
    return json.dumps(body).encode("ascii") + b"\n"


def answer(line: bytes) -> FileReply:
    """The reply to one request line."""
    try:
        request = json.loads(line)
        budget = Budget(time.monotonic() + float(request["remaining_s"]), int(request["max_bytes"]))
        tool, args = request["tool"], request["args"]
    except (ValueError, KeyError, TypeError) as exc:
        return FileReply(f"bad request to the file server: {exc}", "error")
    return dispatch(tool, args, budget)


def send(out: IO[bytes], message: Mapping[str, Any]) -> None:
    out.write(json.dumps(message).encode("ascii") + b"\n")
    out.flush()


def take_limits(opts: Mapping[str, str]) -> None:
    """Memory and file size limits (`--memory-mb N --file-mb N`, 0: none), hard and soft."""
    for name, kind in (("--memory-mb", resource.RLIMIT_DATA), ("--file-mb", resource.RLIMIT_FSIZE)):
        value = int(opts.get(name, "0")) * 1024 * 1024
        if value:
            resource.setrlimit(kind, (value, value))


def become(opts: Mapping[str, str]) -> None:
    """Take the tool user's ids (`--uid N --gid N --groups N,N`), when given. Every
    module is loaded by now, so the tool user need not be able to read them."""
    if "--uid" not in opts:
        return
    os.setgroups([int(g) for g in opts["--groups"].split(",") if g])
    os.setgid(int(opts["--gid"]))
    os.setuid(int(opts["--uid"]))
    if os.getuid() != int(opts["--uid"]) or os.geteuid() != int(opts["--uid"]):
        raise SystemExit("the file server could not become the tool user")


def main(argv: list[str] | None = None) -> int:
    opts = parse_opts(sys.argv[1:] if argv is None else argv)
    take_limits(opts)
    become(opts)
    return serve(answer)


def parse_opts(args: list[str]) -> dict[str, str]:
    return dict(zip(args[::2], args[1::2], strict=True))


def serve(reply_to: Callable[[bytes], FileReply]) -> int:
    """Say ready, then answer each request line until the end of input. The protocol
    keeps its own copies of stdin and stdout; fds 0, 1 and 2 lead nowhere, so nothing
    a tool prints or reads (a user's tool) reaches the worker's pipes."""
    stdin = os.fdopen(os.dup(0), "rb")
    stdout = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    send(stdout, {"ready": os.getpid()})
    while line := stdin.readline(MAX_REQUEST_BYTES + 1):
        if not line.endswith(b"\n"):
            return 2  # longer than any request the worker sends
        reply = reply_to(line)
        send(stdout, {"output": reply.output, "status": reply.status})
    return 0


if __name__ == "__main__":
    sys.exit(main())
