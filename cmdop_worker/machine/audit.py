"""The machine's permission audit log: one JSON line per decision, appended.

Owned by the machine worker, which calls `AuditLog.append` once per tool call after
`permissions.decide` (and, for an "ask", after the person answered or the wait timed
out). Lines are written with one `write` on an `O_APPEND` descriptor under a lock, so
threads and processes sharing the file never interleave within a line. Time comes
from the `clock_ms` callable passed in, so tests are deterministic.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from cmdop_worker.machine.permissions import Decision, primary_arg

# "approved" / "denied" / "timeout" answer an ask ("cancelled": the run ended while
# waiting); allow and deny stand as they are.
FinalVerdict = Literal["allow", "deny", "approved", "denied", "timeout", "cancelled"]
ARG_MAX_CHARS = 200


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def shorten(text: str, max_chars: int = ARG_MAX_CHARS) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


class AuditLog:
    """Append-only JSON-lines file of permission decisions."""

    def __init__(self, path: str | Path, *, clock_ms: Callable[[], int] = wall_clock_ms) -> None:
        self.path = Path(path)
        self._clock_ms = clock_ms
        self._lock = threading.Lock()

    def append(
        self,
        *,
        machine: str,
        run_id: str,
        tool_use_id: str,
        tool: str,
        args: Mapping[str, Any],
        decision: Decision,
        final: FinalVerdict | None = None,
    ) -> dict[str, Any]:
        """Write one line and return it; `final` defaults to the verdict unless it is ask."""
        entry = {
            "ts_ms": self._clock_ms(),
            "machine": machine,
            "run_id": run_id,
            "tool_use_id": tool_use_id,
            "tool": tool,
            "arg": shorten(primary_arg(tool, args)),
            "verdict": decision.verdict,
            "source": decision.source,
            "rule": decision.rule,
            "reason": decision.reason,
            "final": final if final is not None or decision.verdict == "ask" else decision.verdict,
        }
        self._write(json.dumps(entry, separators=(",", ":")) + "\n")
        return entry

    def _write(self, line: str) -> None:
        data = line.encode("utf-8", errors="replace")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
