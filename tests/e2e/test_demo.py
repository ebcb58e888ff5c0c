"""`cmdop-worker demo` from a clean environment, as a new user would run it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cmdop_worker.fleet import free_port

pytestmark = pytest.mark.e2e


def test_demo_runs_to_completion_from_a_clean_environment(tmp_path) -> None:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        # Nothing listens here, so the demo must start a Redis of its own.
        "CMDOP_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
    }
    done = subprocess.run(
        [sys.executable, "-m", "cmdop_worker.cli", "demo"],
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
    # Everything the demo started is gone: no worker of it survives.
    leftover = subprocess.run(["pgrep", "-f", "cmdop_worker.cli worker"], capture_output=True, text=True)
    assert str(tmp_path) not in leftover.stdout
