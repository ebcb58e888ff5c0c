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

from cmdop_worker.machine.process import TERM_GRACE_S, run_command


def proc_state(pid: int) -> str | None:
    """The /proc state letter, or None once the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_gone(pid: int, within_s: float = 1.0) -> bool:
    """Gone or a zombie (killed, waiting to be reaped by whoever inherited it)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if proc_state(pid) in (None, "Z", "X"):
            return True
        time.sleep(0.01)
    return False


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
    assert is_gone(result.pid)


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
    started = time.monotonic()
    result = run_command("sleep 30 & echo $!; wait", timeout_s=0.3)
    elapsed = time.monotonic() - started
    assert result.timed_out and not result.cancelled
    assert result.exit_code < 0
    assert 0.3 <= elapsed < 0.3 + TERM_GRACE_S + 0.5
    grandchild = int(result.stdout.split()[0])
    assert is_gone(result.pid) and is_gone(grandchild)


def test_grandchild_ignoring_sigterm_gets_sigkill() -> None:
    result = run_command("trap '' TERM; sleep 30 & echo $!; wait; wait", timeout_s=0.2)
    assert result.timed_out
    grandchild = int(result.stdout.split()[0])
    assert is_gone(grandchild)


def test_cancel_kills_the_group_quickly() -> None:
    cancel = threading.Event()
    timer = threading.Timer(0.15, cancel.set)
    timer.start()
    started = time.monotonic()
    result = run_command("sleep 30 & echo $!; wait", timeout_s=10, cancelled=cancel)
    after_cancel = time.monotonic() - started - 0.15
    timer.join()
    assert result.cancelled and not result.timed_out
    # The shell dies on SIGTERM, so only the poll interval and the kill stand between.
    assert after_cancel < 0.1
    assert is_gone(result.pid) and is_gone(int(result.stdout.split()[0]))


def test_cancel_set_before_start() -> None:
    cancel = threading.Event()
    cancel.set()
    result = run_command("sleep 30", timeout_s=10, cancelled=cancel)
    assert result.cancelled and result.duration_ms < 1_000
    assert is_gone(result.pid)


def test_background_job_holding_the_pipe_does_not_hang(leftovers: list[int]) -> None:
    result = run_command("sleep 3 & echo $!", timeout_s=10)
    leftovers.append(int(result.stdout.split()[0]))
    assert result.exit_code == 0 and result.duration_ms < 1_500


@pytest.mark.parametrize(
    "command",
    ["nohup sleep 3 >/dev/null 2>&1 & echo $!", "setsid sleep 3 >/dev/null 2>&1 & echo $!"],
)
def test_daemons_left_after_normal_exit_live_on(command: str, leftovers: list[int]) -> None:
    result = run_command(command, timeout_s=5)
    daemon = int(result.stdout.split()[0])
    leftovers.append(daemon)
    assert result.exit_code == 0
    assert proc_state(daemon) not in (None, "Z", "X")


def test_cwd_and_env() -> None:
    result = run_command('pwd; echo "$X"', timeout_s=5, cwd="/", env={"X": "42", "PATH": "/bin"})
    assert result.stdout == "/\n42\n"
