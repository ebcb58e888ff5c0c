"""`cmdop-worker demo` from a clean environment, as a new user would run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cmdop_worker.surfaces.fleet import free_port

pytestmark = pytest.mark.e2e


def test_demo_runs_to_completion_from_a_clean_environment(tmp_path) -> None:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        # Nothing listens here, so the demo must start a Redis of its own.
        "CMDOP_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
    }
    done = subprocess.run(
        [sys.executable, "-m", "cmdop_worker.surfaces.cli", "demo"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "started a private Redis" in out
    assert "execute_command on alpha" in out and "execute_command on beta" in out
    assert "alpha: exit_code: 0" in out
    assert "done: 2 turns" in out
    assert survivors(f"HOME={tmp_path}") == [], "the demo left processes running"


def survivors(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `marker` (the demo's children
    inherit its HOME, so any worker or server it failed to stop shows up here)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
        except OSError:
            continue
        if marker.encode() in environ and "State:\tZ" not in status:
            found.append(int(proc.name))
    return found
