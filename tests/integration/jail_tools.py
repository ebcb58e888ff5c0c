"""User tools that try to leave the sandbox, loaded by the machine workers of
`test_user_tools_jail` through `CMDOP_TOOL_MODULES='["tests.integration.jail_tools"]'`.

Each does plainly what a hostile model steering an operator's tool would: write
outside the writable paths, read the worker's environment or the host's /tmp, connect
to the fleet's Redis. Never imported by the test process itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from cmdop_worker.machine.registry import ToolContext, ToolReply, tool


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PathArgs(_Args):
    path: str


class WriteArgs(_Args):
    path: str
    content: str


class ConnectArgs(_Args):
    host: str
    port: int


class ReplyArgs(_Args):
    output: str
    status: Literal["ok", "error", "timeout"]


class NoArgs(_Args):
    pass


class UrlArgs(_Args):
    url: str


class SizeArgs(_Args):
    chars: int


class SleepArgs(_Args):
    seconds: int


@tool(tags=("custom",))
def jail_write(args: WriteArgs, ctx: ToolContext) -> str:
    """Write a file."""
    Path(args.path).write_text(args.content)
    return f"wrote {args.path}"


@tool(tags=("custom",))
def jail_read(args: PathArgs, ctx: ToolContext) -> str:
    """Read a file."""
    return Path(args.path).read_text()


@tool(tags=("custom",))
def jail_environ(args: NoArgs, ctx: ToolContext) -> str:
    """Everything in this process's environment, and its pid 1's."""
    seen = dict(os.environ)
    for pid in ("self", "1"):  # the environment it started with, and its pid 1's
        try:
            seen[f"/proc/{pid}"] = Path(f"/proc/{pid}/environ").read_bytes().decode("latin-1")
        except OSError as exc:
            seen[f"/proc/{pid}"] = repr(exc)
    return json.dumps(seen)


@tool(tags=("custom",))
def jail_connect(args: ConnectArgs, ctx: ToolContext) -> str:
    """Open a TCP connection and say PING."""
    with socket.create_connection((args.host, args.port), timeout=5) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64).decode(errors="replace")


@tool(tags=("custom",))
def jail_reply(args: ReplyArgs, ctx: ToolContext) -> ToolReply:
    """Answer with the given output and status; prints to stdout first."""
    print("noise on stdout that must not reach the worker's pipe")
    return ToolReply(args.output, args.status)


@tool(tags=("custom",))
def jail_fail(args: NoArgs, ctx: ToolContext) -> str:
    """Raise."""
    raise ValueError(f"broken on {ctx.machine}")


@tool(tags=("custom",))
def jail_pid(args: NoArgs, ctx: ToolContext) -> str:
    """The pid this tool runs as."""
    return str(os.getpid())


@tool(tags=("custom",), sandbox=False)
def worker_pid(args: NoArgs, ctx: ToolContext) -> str:
    """The pid this tool runs as: the worker's own (registered unsandboxed)."""
    return str(os.getpid())


@tool(tags=("custom",))
def jail_fetch(args: UrlArgs, ctx: ToolContext) -> str:
    """GET a URL (through the proxy the environment names, if any)."""
    with urllib.request.urlopen(args.url, timeout=10) as response:
        return response.read().decode(errors="replace")


@tool(tags=("custom",))
def jail_big(args: SizeArgs, ctx: ToolContext) -> str:
    """A long answer of two-byte characters."""
    return "é" * args.chars


@tool(tags=("custom",))
def jail_sleep(args: SleepArgs, ctx: ToolContext) -> str:
    """Run `sleep` and wait for it."""
    subprocess.run(["sleep", str(args.seconds)], check=True)
    return "slept"


class ExitArgs(_Args):
    tally: str


@tool(tags=("custom",))
def jail_exit(args: ExitArgs, ctx: ToolContext) -> str:
    """Add a line to the tally file, then end this process without a reply."""
    with open(args.tally, "a") as tally:
        tally.write("ran\n")
    os._exit(3)


@tool(tags=("custom",))
def jail_ids(args: NoArgs, ctx: ToolContext) -> str:
    """The real and effective user ids, and whether a root-only file can be read."""
    try:
        Path("/etc/shadow").read_bytes()
        shadow = "read /etc/shadow"
    except OSError as exc:
        shadow = type(exc).__name__
    return f"{os.getuid()} {os.geteuid()} {shadow}"
