"""`cmdop-worker` driven as a person or a script drives it: subprocesses, signals, a pty.

`--json` lines must each parse as an event; exit codes follow the terminal event;
piped output is plain; Ctrl-C cancels; and in a real terminal (tmux) the live view
shows a spinner per running tool with its machine and a ticking elapsed time.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.models import Event
from cmdop_worker.surfaces.fleet import RedisServer, free_port
from cmdop_worker.surfaces.typed_events import typed_event
from tests.procs import gone_within, sleeper, wait_for_sleeper

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).with_name("cmdop-worker"))
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def tool(machine: str, command: str) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "name": "execute_command",
        "input": {"machine": machine, "command": command},
    }


def text(value: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": value}]


@pytest.fixture
def cli_env(fleet, fleet_env) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, **fleet_env, "NO_COLOR": "", "COLUMNS": "100"}


def cli(env: dict[str, str], *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=timeout_s)


def test_json_lines_are_events_and_done_exits_0(cli_env, script) -> None:
    prompt = script([[tool("alpha", "echo one"), tool("beta", "echo two")], text("both ok")])
    done = cli(cli_env, "run", prompt, "--json")
    assert done.returncode == 0, done.stderr
    events = [Event.model_validate_json(line) for line in done.stdout.splitlines()]
    for event in events:
        typed_event(event)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-1].type == "DONE" and events[-1].data["text"] == "both ok"
    machines = {e.data["machine"] for e in events if e.type == "TOOL_END"}
    assert machines == {"alpha", "beta"}

    replay = cli(cli_env, "events", events[0].run_id, "--json")
    assert replay.returncode == 0
    assert replay.stdout == done.stdout


def test_an_error_exits_1(cli_env, script) -> None:
    prompt = script([{"content": text("never"), "fault": {"status": 400, "times": 50}}])
    done = cli(cli_env, "run", prompt, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    last = Event.model_validate_json(done.stdout.splitlines()[-1])
    assert last.type == "ERROR" and last.data["kind"] == "model_http_400"


def test_a_cancelled_run_exits_130(cli_env, script) -> None:
    prompt = script([[tool("alpha", "sleep 30")]])
    proc = subprocess.Popen(
        [CLI, "run", prompt, "--json"], env=cli_env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    first = Event.model_validate_json(proc.stdout.readline())
    cancel = cli(cli_env, "cancel", first.run_id, "--ui")
    assert cancel.returncode == 0 and "cancel (ui) sent" in cancel.stdout
    rest, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert Event.model_validate_json(rest.splitlines()[-1]).type == "CANCELLED"


def test_a_request_the_fleet_refuses_exits_2_with_its_message(cli_env) -> None:
    done = cli(cli_env, "run", "hello", "--agent", "nobody-by-that-name")
    assert done.returncode == 2
    assert "unknown agent 'nobody-by-that-name'" in done.stderr


def test_piped_output_is_plain_text(cli_env, script) -> None:
    prompt = script([[tool("alpha", "echo from-alpha")], text("alpha said {{result:0}}")])
    done = cli(cli_env, "run", prompt)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert not ANSI.search(out), repr(out)
    lines = out.splitlines()
    assert lines[0].startswith("run ")
    assert any(
        line.startswith("▶ execute_command on alpha command=echo from-alpha") for line in lines
    )
    assert any(line.startswith("✓ execute_command on alpha (") for line in lines)
    assert "alpha said exit_code: 0" in out
    summary = lines[-1]
    assert re.match(
        r"── done: 2 turns · \d+ in · \d+ cache read · \d+ cache write · \d+ out · "
        r"(\$\d+\.\d{4}|cost unknown) · [\d.]+s · end_turn",
        summary,
    ), summary


def test_machines_prints_a_table_of_the_fleet(cli_env) -> None:
    done = cli(cli_env, "machines")
    assert done.returncode == 0
    rows = [line for line in done.stdout.splitlines() if "execute_command" in line]
    assert sorted(row.split()[1] for row in rows) == ["alpha", "beta"]


def test_a_one_turn_run_says_1_turn(cli_env, script) -> None:
    done = cli(cli_env, "run", script([text("just this")]))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("── done: 1 turn · "), done.stdout


def test_the_replay_summary_gives_the_time_the_run_gave(cli_env, script) -> None:
    prompt = script([[tool("alpha", "sleep 0.6")], text("slept")])
    done = cli(cli_env, "run", prompt)
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.splitlines()[0].split()[1]
    time.sleep(0.5)  # a replay's own wall clock must not leak into the summary
    replay = cli(cli_env, "events", run_id)
    summary = done.stdout.splitlines()[-1]
    assert replay.stdout.splitlines()[-1] == summary
    took_s = float(re.findall(r" · ([\d.]+)s · ", summary)[0])
    assert took_s >= 0.6, summary


def test_run_with_no_coordinator_shows_its_id_warns_and_keeps_its_timeout(cli_env) -> None:
    lonely = RedisServer().start()  # a Redis no coordinator has registered with
    try:
        env = {**cli_env, "CMDOP_REDIS_URL": lonely.url}
        for as_json in (False, True):
            started = time.monotonic()
            done = cli(env, "run", "hello", "--timeout", "1", *(["--json"] * as_json), timeout_s=20)
            assert done.returncode == 1, done.stdout + done.stderr
            assert time.monotonic() - started < 10
            header = done.stderr if as_json else done.stdout
            assert re.match(r"run [0-9a-f]{32}\n", header), header
            assert "warning: no coordinator is running" in done.stderr
            assert "did not start within 1 s (--timeout): no coordinator took it" in done.stderr
            if as_json:
                assert done.stdout == ""  # stdout stays one event a line
    finally:
        lonely.stop()


@pytest.mark.parametrize(
    "args",
    [["machines"], ["run", "hi"], ["events", "r1"], ["cancel", "r1"], ["approve", "r1", "t1"]],
)
def test_redis_unreachable_is_one_line_with_the_password_masked(cli_env, args) -> None:
    port = free_port()
    env = {**cli_env, "CMDOP_REDIS_URL": f"redis://:hunter2@127.0.0.1:{port}/0"}
    done = cli(env, *args, timeout_s=30)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        f"cmdop-worker: cannot reach Redis at redis://:***@127.0.0.1:{port}/0 "
        "(Connection refused); is it running? set CMDOP_REDIS_URL\n"
    )


def _start_sleeping_run(
    cli_env: dict[str, str], script: Any, command: str = "sleep 30"
) -> tuple[subprocess.Popen[str], list[str]]:
    prompt = script([[tool("alpha", command)], text("slept")])
    proc = subprocess.Popen(
        [CLI, "run", prompt], env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("▶ execute_command on alpha"):
            return proc, seen
    raise AssertionError(f"the tool never started: {seen}")


def test_ctrl_c_cancels_the_run_and_exits_130(cli_env, script, tmp_path) -> None:
    sleep = sleeper(30)
    proc, _ = _start_sleeping_run(cli_env, script, sleep)
    # The tool sleeps 30 s; everything below gives up within 20 s of its start, so a
    # tool the cancel did not kill is still alive when the checks end.
    give_up = time.monotonic() + 20
    pid = wait_for_sleeper(sleep, 20)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=max(1.0, give_up - time.monotonic()))
    assert proc.returncode == 130, out + err
    assert "cancelling the run" in err
    assert "✗ execute_command on alpha" in out
    assert "cancelled (ui: Ctrl-C)" in out
    assert gone_within(pid, max(0.0, give_up - time.monotonic())), "the cancel did not kill it"


def test_a_second_ctrl_c_quits_at_once(cli_env, script) -> None:
    proc, seen = _start_sleeping_run(cli_env, script)
    run_id = seen[0].split()[1]
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=5)
    assert proc.returncode == 130
    # The first Ctrl-C's cancel still reached the run.
    events = cli(cli_env, "events", run_id, "--json").stdout.splitlines()
    assert Event.model_validate_json(events[-1]).type == "CANCELLED"


TMUX = shutil.which("tmux")


@pytest.mark.skipif(TMUX is None and not os.environ.get("CI"), reason="tmux not installed")
def test_the_live_view_in_a_real_terminal(cli_env, script, tmp_path) -> None:
    assert TMUX is not None, "CI installs tmux (.ci/run)"
    prompt = script(
        [
            [
                *text("Checking both."),
                tool("alpha", "sleep 2.5; echo a"),
                tool("beta", "sleep 2.5; echo b"),
            ],
            text("Both machines answered: {{results}}"),
        ],
        token_delay_ms=5,
    )
    screen = TmuxScreen(TMUX, tmp_path, cli_env)
    try:
        screen.start(f"{CLI} run '{prompt}'")
        first = screen.wait_for(
            lambda s: "execute_command on alpha" in s and re.search(r"on beta \d+\.\ds", s)
        )
        time.sleep(1.0)
        later = screen.capture()
        final = screen.wait_for(lambda s: "── done:" in s)
    finally:
        screen.close()
    # A spinner frame, the tool, its machine and an elapsed time that ticks on its own.
    assert re.search(r"[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏] execute_command on alpha \d+\.\ds", first), first
    assert _elapsed(later, "beta") > _elapsed(first, "beta"), (first, later)
    assert "✓ execute_command on beta" in final and "Both machines answered:" in final
    assert not re.search(r"[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]", final)  # the live block is gone at the end


def _elapsed(screen: str, machine: str) -> float:
    match = re.search(rf"execute_command on {machine} (\d+\.\d)s", screen)
    assert match, screen
    return float(match.group(1))


class TmuxScreen:
    """A detached tmux session of its own socket: a real terminal, read as text."""

    def __init__(self, tmux: str, workdir: Path, env: dict[str, str]) -> None:
        self.tmux, self.socket, self.env = tmux, str(workdir / "tmux.sock"), env

    def _tmux(self, *args: str) -> str:
        return subprocess.run(
            [self.tmux, "-S", self.socket, *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def start(self, command: str, *, rows: int = 30) -> None:
        env = {**self.env, "TERM": "xterm-256color"}
        self.env = env
        self._tmux(
            "new-session", "-d", "-x", "110", "-y", str(rows), "-s", "cli", f"{command}; sleep 30"
        )

    def capture(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "cli")

    def send(self, *keys: str) -> None:
        """Type `keys` (tmux key names such as Enter, C-c and C-d are keys too)."""
        self._tmux("send-keys", "-t", "cli", *keys)

    def wait_for(self, ready: Any, timeout_s: float = 30) -> str:
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            screen = self.capture()
            if ready(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"the screen never got there:\n{self.capture()}")

    def close(self) -> None:
        subprocess.run([self.tmux, "-S", self.socket, "kill-server"], capture_output=True)


class _NeverEndingRun:
    def __init__(self) -> None:
        self.cancels: list[tuple[str, bool]] = []

    def run(self, run_id: str) -> _NeverEndingRun:
        self.run_id = run_id
        return self

    def events(self) -> Any:
        while True:
            time.sleep(0.01)
            yield from ()

    def cancel(self, run_id: str, *, ui: bool, reason: str, submitted: bool = False) -> bool:
        self.cancels.append((run_id, ui))
        return True


class _NullView:
    def show(self, event: Any) -> None:
        pass

    def close(self) -> None:
        pass


def test_first_ctrl_c_sends_one_ui_cancel_and_the_second_quits(capsys) -> None:
    from cmdop_worker.surfaces.cli import follow

    client = _NeverEndingRun()

    def press_twice() -> None:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own handler, whatever this process inherited: under `pytest &` from a
    # script SIGINT starts ignored, and follow is to put back what it found.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=press_twice).start()
        with pytest.raises(KeyboardInterrupt):
            follow(client, "r-1", _NullView(), cancel_on_interrupt=True)
        assert client.cancels == [("r-1", True)]
        assert "Ctrl-C again to quit" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)
