"""The operator's own Python tools run in the call's sandbox: the worker's side.

`run_user_tool` is the default registry's jail runner (`ToolRegistry(jail_runner=…)`):
`ToolRegistry.reply` hands it every call of a tool registered with `sandbox=True` (the
default) whose call has a bwrap jail. It sends the validated call to a server
(`toolserve`) from the pool of `filejail`, started inside bubblewrap with the call's
confinement and, unlike a file tools' server, the call's network (the egress proxy):
the tool writes only where `touch` could, sees the sandbox's private `/tmp`, none of
the worker's environment, and no route to the fleet's Redis. The server imports the
same `CMDOP_TOOL_MODULES` the worker did (`host` records them, with the directories
they were imported from). With the sandbox off the registry runs the tool in-process.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any, cast

from cmdop_worker.machine.filejail import pool
from cmdop_worker.machine.fileproc import Hosting
from cmdop_worker.machine.sandbox import Confinement
from cmdop_worker.machine.toolcall import CappedReply, ToolContext, ToolReply
from cmdop_worker.models import ToolStatus

_hosting = Hosting()
_hosting_lock = threading.Lock()


def host(modules: Iterable[str]) -> Hosting:
    """Record the tool modules this process imported, for its sandboxed tool servers."""
    global _hosting
    names = tuple(dict.fromkeys(modules))
    paths = tuple(dict.fromkeys((*import_roots(names), *python_path(os.environ))))
    with _hosting_lock:
        _hosting = Hosting(modules=names, paths=paths)
        return _hosting


def python_path(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The directories of `PYTHONPATH` (which `-I` makes the server ignore), where a
    tool module may find what it imports later."""
    entries = environ.get("PYTHONPATH", "").split(os.pathsep)
    return tuple(os.path.realpath(entry) for entry in entries if os.path.isabs(entry))


def import_roots(modules: Iterable[str]) -> tuple[str, ...]:
    """The `sys.path` entries the (imported) modules came from: the parent of a
    top-level package's directory, or a top-level module's directory."""
    roots: dict[str, None] = {}
    for name in modules:
        top = sys.modules.get(name.split(".")[0])
        spec = getattr(top, "__spec__", None)
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        where = locations[0] if locations else spec.origin
        if where and os.path.isabs(where):
            roots[os.path.dirname(os.path.realpath(where))] = None
    return tuple(roots)


def warm(jail: Confinement, cwd: str) -> None:
    """Start a tool server for calls of this confinement, in the background."""
    if _hosting.modules and jail.bwrap is not None:
        pool().warm_later(jail, cwd, _hosting)


def run_user_tool(tool: str, args: Mapping[str, Any], ctx: ToolContext) -> ToolReply:
    """Run a validated call of a user's tool in a sandboxed tool server."""
    jail = ctx.jail
    assert jail is not None and jail.bwrap is not None, "the registry routes only jailed calls"
    hosting = _hosting
    if not hosting.modules:
        why = f"{tool} runs in the sandbox, but no tool modules were loaded (CMDOP_TOOL_MODULES)"
        return ToolReply(why, "error")
    try:
        request = encode_request(tool, args, ctx)
    except (TypeError, ValueError) as exc:
        return ToolReply(f"invalid input for {tool}: {exc}", "invalid")
    reply = pool().call(tool, request, jail, ctx, hosting)
    return CappedReply(reply.output, cast(ToolStatus, reply.status))


def encode_request(tool: str, args: Mapping[str, Any], ctx: ToolContext) -> bytes:
    """One request line (ASCII), the call's context with it (`toolserve`)."""
    given = {"machine": ctx.machine, "run_id": ctx.run_id, "tool_use_id": ctx.tool_use_id}
    body = {
        "tool": tool,
        "args": dict(args),
        "remaining_s": ctx.remaining_s(),
        "max_bytes": ctx.output_max_bytes,
        "ctx": {**given, "cwd": ctx.cwd},
    }
    return json.dumps(body).encode("ascii") + b"\n"
