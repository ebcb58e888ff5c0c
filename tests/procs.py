"""Waiting in tests: for a condition, for a tool to start (its pid file), for a process
to be gone. Every wait is bounded and names what it waited for when it gives up."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """The first truthy value `check` returns within `timeout_s`; AssertionError if none."""
    give_up = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= give_up:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.02)


def process_gone(pid: int) -> bool:
    """Gone, or a zombie (killed, waiting to be reaped by whoever inherited it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def gone_within(pid: int, timeout_s: float) -> bool:
    """Whether the process is gone by `timeout_s` from now."""
    give_up = time.monotonic() + timeout_s
    while not process_gone(pid):
        if time.monotonic() >= give_up:
            return False
        time.sleep(0.01)
    return True


def wait_for_pid(pid_file: Path, timeout_s: float = 10) -> int:
    """The pid a tool wrote (`echo $$ > FILE`) once it has started."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        text = pid_file.read_text().strip() if pid_file.exists() else ""
        if text:
            return int(text)
        time.sleep(0.01)
    raise AssertionError("the tool never started")


def ui_cancel_stops(run: Any, pid: int, within_s: float = 20) -> None:
    """A ui cancel ends `run` (a `client.Run`) cancelled from the ui channel, and the
    tool process `pid` is gone within `within_s` of asking. Give the tool a longer
    sleep than that, so one the cancel did not reach is still alive when this fails."""
    asked = time.monotonic()
    assert run.cancel(ui=True)
    result = run.wait(timeout=15, raise_on_failure=False)
    assert result.status == "cancelled"
    assert result.cancel is not None and result.cancel.channel == "ui"
    left_s = max(0.0, asked + within_s - time.monotonic())
    assert gone_within(pid, left_s), "the ui cancel did not kill the tool"
