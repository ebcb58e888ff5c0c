"""One tool call as its tool sees it: the `ToolContext` it is given, the `ToolReply` it
may return.

These values are what a tool function, the built-ins (`builtin`), the sandboxed
servers' clients (`filejail`, `tooljail`) and the worker (`worker`) exchange; the
registry that validates and runs calls (`registry`) imports them, and so can import
the built-ins and the jail runner without their importing it back. A tool module
imports them from `registry`, beside `@tool`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from cmdop_worker.machine.sandbox import Confinement
from cmdop_worker.models import ToolStatus


@dataclass(frozen=True)
class ToolContext:
    """What a tool knows about the call it serves."""

    machine: str
    run_id: str
    tool_use_id: str
    deadline_monotonic: float  # absolute time.monotonic() by which the tool must end
    cancelled: threading.Event  # set when the run is cancelled: stop at once, kill children
    output_max_bytes: int = 64_000
    cwd: str | None = None  # where its processes run; None: this process's own
    jail: Confinement | None = None  # how its processes are confined; None: unconfined

    def remaining_s(self) -> float:
        return self.deadline_monotonic - time.monotonic()


@dataclass(frozen=True)
class ToolReply:
    """A tool's answer with its own status (e.g. "timeout", "cancelled", "error")."""

    output: str
    status: ToolStatus = "ok"


@dataclass(frozen=True)
class CappedReply(ToolReply):
    """A reply already cut by `cap_output` to the call's `output_max_bytes` (where the
    tool ran: only that much crosses a sandboxed server's pipe); not cut again."""
