"""run_command: capture, caps, exit codes, and killing whole process groups."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmdop_worker.machine.process import run_command
from tests.procs import gone_within, process_gone


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """Pids a test leaves alive on purpose; killed afterwards."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("command", "exit_code", "stdout", "stderr"),
    [
        ("echo hello", 0, "hello\n", ""),
        ("echo oops >&2; exit 3", 3, "", "oops\n"),
        ("printf 'a'; printf 'b' >&2", 0, "a", "b"),
        ("exit 0", 0, "", ""),
        ("kill -9 $$", -9, "", ""),
    ],
)
def test_captures_output_and_exit_code(
    command: str, exit_code: int, stdout: str, stderr: str
) -> None:
    result = run_command(command, timeout_s=5)
    assert (result.exit_code, result.stdout, result.stderr) == (exit_code, stdout, stderr)
    assert not result.timed_out and not result.cancelled
    assert result.stdout_truncated_bytes == result.stderr_truncated_bytes == 0
    assert gone_within(result.pid, 1.0)


def test_invalid_utf8_is_replaced() -> None:
    result = run_command(r"printf 'ok \377\376 end'", timeout_s=5)
    assert result.stdout == "ok \ufffd\ufffd end"


def test_stdin_is_devnull() -> None:
    result = run_command("cat; echo done", timeout_s=5)
    assert result.stdout == "done\n"


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_caps_each_stream_and_keeps_draining(stream: str) -> None:
    redirect = "" if stream == "stdout" else ">&2"
    # 1 MB is far more than a pipe buffer: the child only finishes if we keep reading.
    result = run_command(f"head -c 1000000 /dev/zero | tr '\\0' a {redirect}", timeout_s=5)
    assert result.exit_code == 0 and not result.timed_out
    captured = getattr(result, stream)
    dropped = getattr(result, f"{stream}_truncated_bytes")
    assert captured == "a" * 64_000
    assert dropped == 1_000_000 - 64_000


def test_small_cap() -> None:
    result = run_command("echo 0123456789", timeout_s=5, max_bytes=4)
    assert (result.stdout, result.stdout_truncated_bytes) == ("0123", 7)


def test_timeout_kills_the_group_including_a_grandchild() -> None:
    result = run_command("sleep 30 & echo $!; wait", timeout_s=0.3)
    assert result.timed_out and not result.cancelled
    # Killed by a signal: a shell that waited out the sleep would have exited 0.
    assert result.exit_code < 0
    # Never before the timeout (load can only make this larger).
    assert result.duration_ms >= 300 - 1
    grandchild = int(result.stdout.split()[0])
    assert gone_within(result.pid, 1.0) and gone_within(grandchild, 1.0)


def test_grandchild_ignoring_sigterm_gets_sigkill() -> None:
    result = run_command("trap '' TERM; sleep 30 & echo $!; wait; wait", timeout_s=0.2)
    assert result.timed_out
    grandchild = int(result.stdout.split()[0])
    assert gone_within(grandchild, 1.0)


def test_cancel_kills_the_group(tmp_path: Path) -> None:
    started = tmp_path / "started"
    cancel = threading.Event()

    def cancel_once_running() -> None:
        # Cancel only once the command runs, so this is a kill, not a refusal to start.
        end = time.monotonic() + 20
        while not started.exists() and time.monotonic() < end:
            time.sleep(0.01)
        cancel.set()

    canceller = threading.Thread(target=cancel_once_running)
    canceller.start()
    # The tool's own timeout (30 s) is far off: only the cancel can end this early.
    result = run_command(
        f"sleep 60 & echo $!; touch {started}; wait", timeout_s=30, cancelled=cancel
    )
    canceller.join()
    assert started.exists()
    assert result.cancelled and not result.timed_out
    assert result.exit_code < 0
    assert gone_within(result.pid, 1.0) and gone_within(int(result.stdout.split()[0]), 1.0)


def test_cancel_set_before_start() -> None:
    cancel = threading.Event()
    cancel.set()
    result = run_command("sleep 30", timeout_s=30, cancelled=cancel)
    assert result.cancelled and not result.timed_out
    assert result.exit_code < 0
    assert gone_within(result.pid, 1.0)


def test_background_job_holding_the_pipe_does_not_hang(leftovers: list[int]) -> None:
    result = run_command("sleep 30 & echo $!", timeout_s=10)
    sleeper = int(result.stdout.split()[0])
    leftovers.append(sleeper)
    assert result.exit_code == 0 and not result.timed_out
    # run_command returned while the job still holds the pipe: it did not wait for it.
    assert not process_gone(sleeper)


@pytest.mark.parametrize(
    "command",
    ["nohup sleep 3 >/dev/null 2>&1 & echo $!", "setsid sleep 3 >/dev/null 2>&1 & echo $!"],
)
def test_daemons_left_after_normal_exit_live_on(command: str, leftovers: list[int]) -> None:
    result = run_command(command, timeout_s=5)
    daemon = int(result.stdout.split()[0])
    leftovers.append(daemon)
    assert result.exit_code == 0
    assert not process_gone(daemon)


def test_cwd_and_env() -> None:
    result = run_command('pwd; echo "$X"', timeout_s=5, cwd="/", env={"X": "42", "PATH": "/bin"})
    assert result.stdout == "/\n42\n"
