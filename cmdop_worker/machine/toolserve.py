"""The server that runs the operator's own Python tools inside a call's sandbox.

    python -I -m cmdop_worker.machine.toolserve --tool-modules JSON --tool-paths JSON
        [--memory-mb N --file-mb N] [--uid N --gid N --groups N,N]

started by `tooljail` (through the pool of `filejail`, by `fileproc`) inside bubblewrap
with the call's confinement and the call's network: a `@tool` function runs where
`execute_command` would, never in the worker. It puts the tool modules' import roots
(`--tool-paths`) on `sys.path`, imports the modules (`CMDOP_TOOL_MODULES`, as the
worker did) while it is still the worker's user, then becomes the tool user and
serves `fileserver`'s JSON-lines protocol, each request carrying the call's context:

    <- {"tool": "disk_free", "args": {...}, "remaining_s": 9.5, "max_bytes": 64000,
        "ctx": {"machine": "m", "run_id": "r", "tool_use_id": "t", "cwd": "/srv"}}
    -> {"output": "...", "status": "ok"}

The call runs through the same `ToolRegistry.reply` as in the worker, so validation
errors and a tool's exception read the same either way. Its context's `cancelled` is
never set: a ui cancel kills this server. Output is cut to the call's `max_bytes` here.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from collections.abc import Mapping

from cmdop_worker.core.tools import cap_output
from cmdop_worker.machine.fileops import FileReply
from cmdop_worker.machine.fileserver import become, parse_opts, serve, take_limits
from cmdop_worker.machine.registry import ToolContext, ToolRegistry, default_registry


def load(opts: Mapping[str, str]) -> ToolRegistry:
    """The registry with the operator's tool modules imported, from their own roots."""
    roots = [str(p) for p in json.loads(opts.get("--tool-paths", "[]"))]
    sys.path[:0] = [root for root in roots if root not in sys.path]
    for module in json.loads(opts.get("--tool-modules", "[]")):
        importlib.import_module(str(module))
    # Loaded on first use by any client that resolves a name; the tool user may not
    # be able to read this Python's standard library (a pyenv under /root).
    importlib.import_module("encodings.idna")
    return default_registry()


def answer(registry: ToolRegistry, line: bytes) -> FileReply:
    """The reply to one request line: the tool's own, or why there is none."""
    try:
        request = json.loads(line)
        tool, args, given = str(request["tool"]), request["args"], request["ctx"]
        remaining_s, max_bytes = float(request["remaining_s"]), int(request["max_bytes"])
        ctx = ToolContext(
            machine=str(given["machine"]),
            run_id=str(given["run_id"]),
            tool_use_id=str(given["tool_use_id"]),
            deadline_monotonic=time.monotonic() + remaining_s,
            cancelled=threading.Event(),  # a cancel kills this process instead
            output_max_bytes=max_bytes,
            cwd=given.get("cwd"),
            jail=None,  # it is in the jail already
        )
    except (ValueError, KeyError, TypeError) as exc:
        return FileReply(f"bad request to the tool server: {exc}", "error")
    if not registry.sandboxed(tool):
        return FileReply(f"{tool} is not a sandboxed tool of this machine", "error")
    reply = registry.reply(tool, args, ctx)
    return FileReply(cap_output(reply.output, max_bytes), reply.status)


def main(argv: list[str] | None = None) -> int:
    opts = parse_opts(sys.argv[1:] if argv is None else argv)
    take_limits(opts)
    registry = load(opts)  # as the worker's user: its modules may be closed to the tool user
    become(opts)
    return serve(lambda line: answer(registry, line))


if __name__ == "__main__":
    sys.exit(main())
