"""docs/quickstart.md run as written: every block it marks, in its order.

A shell block preceded by `<!-- quickstart: NAME -->` is run here through bash, as a
person would paste it. The long-running ones (Redis, the fake model, the workers,
Flower) start in the background, each in a process group of its own, and end with
Ctrl-C's signal; the others run to completion, and their output is checked. The
environment is the doc's, moved out of the way the demo's test moves it: free ports
in place of the doc's, a temporary HOME and working directory (with `config/` linked
from the repository), and this interpreter's scripts first on PATH, as an activated
virtualenv has them. A block the doc marks and this test does not run fails it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cmdop_worker.surfaces.fleet import find_redis_server, free_port
from tests.e2e.test_demo import survivors
from tests.net import http_status
from tests.procs import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "docs" / "quickstart.md"
MARKED_BLOCK = re.compile(r"<!-- quickstart: ([\w-]+) -->\n```sh\n(.*?)```", re.S)
DOC_PORTS = (6380, 8765, 5555)  # Redis, the fake model, Flower
APPROVE = re.compile(r"cmdop-worker approve ([0-9a-f]+) ([\w-]+)")


def marked_blocks(text: str) -> dict[str, str]:
    """The doc's marked shell blocks by name; a marker without its block is an error."""
    blocks = dict(MARKED_BLOCK.findall(text))
    markers = re.findall(r"<!-- quickstart: ([\w-]+) -->", text)
    assert sorted(blocks) == sorted(markers), "a quickstart marker is not right above a sh block"
    return blocks


@dataclass
class Background:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float = 60) -> str:
        def shown() -> bool:
            out = self.output()
            if text not in out and self.process.poll() is not None:
                code = self.process.returncode
                raise AssertionError(f"{self.name} exited {code} before {text!r}:\n{out[-3000:]}")
            return text in out

        wait_for(shown, timeout_s, f"{self.name} showing {text!r}")
        return self.output()

    def finish(self, timeout_s: float = 60) -> str:
        """Its output once it has exited 0 by itself."""
        code = self.process.wait(timeout=timeout_s)
        assert code == 0, f"{self.name} exited {code}:\n{self.output()[-3000:]}"
        return self.output()

    def interrupt(self, timeout_s: float = 15) -> None:
        """Ctrl-C, as in its terminal; killed if it does not stop in time."""
        for signum in (signal.SIGINT, signal.SIGKILL):
            if self.process.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_s)


@dataclass
class Shell:
    """Runs the doc's blocks: once the `env` block is run, it leads every later one."""

    home: Path
    env: dict[str, str]
    blocks: dict[str, str]
    ports: dict[int, int] = field(default_factory=lambda: {p: free_port() for p in DOC_PORTS})
    exports: str = ""
    used: set[str] = field(default_factory=set)
    background: list[Background] = field(default_factory=list)

    def code(self, name: str, **words: str) -> str:
        assert name in self.blocks, f"docs/quickstart.md has no block {name!r}"
        self.used.add(name)
        text = self.blocks[name]
        for doc_port, port in self.ports.items():
            text = re.sub(rf"\b{doc_port}\b", str(port), text)
        for word, value in words.items():
            text = text.replace(word, value)
        return self.exports + text

    def run(self, name: str, **words: str) -> str:
        done = subprocess.run(
            ["bash", "-e", "-c", self.code(name, **words)],
            cwd=self.home,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{name} exited {done.returncode}:\n{out}"
        return out

    def start(
        self, name: str, *, ready: str | None = None, label: str = "", **words: str
    ) -> Background:
        log = self.home / "logs" / f"{label or name}.log"
        log.parent.mkdir(exist_ok=True)
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["bash", "-c", self.code(name, **words)],
                cwd=self.home,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started = Background(label or name, process, log)
        self.background.append(started)
        if ready is not None:
            started.wait_for(ready)
        return started

    def use_exports(self, name: str) -> None:
        self.exports = self.code(name)

    def stop(self) -> None:
        for started in reversed(self.background):
            started.interrupt()


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[Shell]:
    (tmp_path / "config").symlink_to(REPO / "config")
    path = [str(Path(sys.executable).parent)]
    if shutil.which("redis-server") is None:  # the doc offers the wheel's server instead
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "redis-server").symlink_to(find_redis_server())
        path.append(str(tmp_path / "bin"))
    env = {"PATH": os.pathsep.join([*path, os.environ["PATH"]]), "HOME": str(tmp_path)}
    session = Shell(tmp_path, env, marked_blocks(QUICKSTART.read_text()))
    try:
        yield session
    finally:
        session.stop()
    assert survivors(f"HOME={tmp_path}") == [], "the quickstart left processes running"


def test_the_quickstart_runs_as_written(shell: Shell) -> None:
    bring_the_fleet_up(shell)
    run_allowed_and_denied(shell)
    approve_and_deny(shell)
    watch_in_flower(shell)
    assert shell.used == set(shell.blocks), "blocks the doc marks but this test never ran"


def bring_the_fleet_up(shell: Shell) -> None:
    shell.start("redis", ready="Ready to accept connections")
    fake = shell.start("fake-model", ready="serving until Ctrl-C")
    shell.use_exports("env")
    printed = fake.output().splitlines()[0]
    assert f"{printed}\n" in shell.exports, "the env block exports another ANTHROPIC_BASE_URL"
    assert "check, disk, reboot" in fake.output()
    assert shell.run("policy") == ""
    assert (shell.home / "policy.toml").exists()
    coordinator = shell.start("coordinator")
    machines = [shell.start("alpha"), shell.start("beta")]
    coordinator.wait_for("cmdop worker ready (coordinator)")
    for machine in machines:
        machine.wait_for(f"cmdop worker ready ({machine.name})")
    assert "ANTHROPIC_API_KEY" not in coordinator.output()  # no warning: the model is set
    online = shell.run("machines")
    assert "alpha" in online and "beta" in online


def run_allowed_and_denied(shell: Shell) -> None:
    out = shell.run("run-check")
    assert "✓ execute_command on alpha" in out and "✓ execute_command on beta" in out
    assert "alpha: exit_code: 0" in out and "| beta: exit_code: 0" in out
    assert "needs approval" not in out
    assert "done: 2 turns" in out

    out = shell.run("run-reboot")
    assert "✗ execute_command on beta" in out
    assert "permission denied" in out and "reboot*" in out
    assert "beta answered: " in out and "done: 2 turns" in out


def approve_and_deny(shell: Shell) -> None:
    for answer, label in (("approve", "run-disk-approved"), ("deny", "run-disk-denied")):
        run = shell.start("run-disk", ready="needs approval", label=label)
        found = APPROVE.search(run.output())
        assert found, run.output()
        said = shell.run(answer, RUN_ID=found.group(1), TOOL_CALL_ID=found.group(2))
        out = run.finish()
        assert "done: 2 turns" in out
        if answer == "approve":
            assert said.startswith("approved") and found.group(2) in said
            assert "✓ execute_command on alpha" in out and "Filesystem" in out
        else:
            assert said.startswith("denied") and found.group(2) in said
            assert "permission denied by a person" in out


def watch_in_flower(shell: Shell) -> None:
    shell.start("flower", ready="Visit me at")
    user, password = re.findall(r"--basic-auth=(\S+?):(\S+)", shell.blocks["flower"])[0]
    url = f"http://127.0.0.1:{shell.ports[5555]}"
    assert http_status(f"{url}/") == 401
    assert http_status(f"{url}/", auth=f"{user}:{password}") == 200
    assert http_status(f"{url}/", auth=f"{user}:wrong") == 401
