"""`cmdop-worker chat` in a real terminal (tmux), typed into as a person types: follow-ups
on one thread, a line that steers a busy run, Ctrl-C that stops a run and stays, Ctrl-D
that leaves; a waiting call answered only by /approve, /deny and /edit."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import pytest

from tests.e2e.test_cli import CLI, TMUX, TmuxScreen, text, tool

pytestmark = pytest.mark.e2e


@pytest.fixture
def chat_env(fleet, fleet_env) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, **fleet_env, "COLUMNS": "110"}


def typed(screen: TmuxScreen, line: str) -> None:
    screen.send("-l", line)
    screen.send("Enter")


@pytest.mark.skipif(TMUX is None and not os.environ.get("CI"), reason="tmux not installed")
def test_a_conversation_with_follow_ups_steering_and_ctrl_c(
    chat_env, script, client, tmp_path
) -> None:
    assert TMUX is not None, "CI installs tmux (.ci/run)"
    prompt = script(
        [
            text("first answer"),
            text("second answer"),
            [*text("sleeping a little"), tool("alpha", "sleep 3")],
            text("heard: {{last_user_text}}"),
            [tool("alpha", "sleep 60")],
            text("still here"),
        ]
    )
    thread_id = f"chat-{uuid.uuid4().hex[:10]}"
    screen = TmuxScreen(TMUX, tmp_path, chat_env)
    try:
        screen.start(
            f"{CLI} chat --machine alpha --thread {thread_id}; echo CHAT-EXIT=$?", rows=150
        )
        screen.wait_for(lambda s: f"thread {thread_id}" in s)
        typed(screen, prompt)
        screen.wait_for(lambda s: "first answer" in s and "── done" in s)
        typed(screen, "and on db-1?")
        screen.wait_for(lambda s: "second answer" in s)

        typed(screen, "now the slow one")
        screen.wait_for(lambda s: "▶ execute_command on alpha" in s and "sleep 3" in s)
        typed(screen, "also db-2")  # while the tool runs: it steers that run
        steered = screen.wait_for(lambda s: "heard:" in s and s.count("── done") >= 3)
        assert "↪ steered: also db-2" in steered

        typed(screen, "and the long one")
        screen.wait_for(lambda s: "sleep 60" in s)
        screen.send("C-c")
        screen.wait_for(lambda s: "cancelled (ui: Ctrl-C)" in s)
        typed(screen, "are you still there?")  # the chat stayed, on the same thread
        screen.wait_for(lambda s: "still here" in s and s.count("── done") >= 4)
        screen.send("C-d")
        final = screen.wait_for(lambda s: "CHAT-EXIT=0" in s)
    finally:
        screen.close()
    assert "Traceback" not in final
    info = client.thread(thread_id)
    assert info is not None and len(info.runs) == 5 and info.active is None
    results = [client.result(run_id) for run_id in info.runs]
    assert [r.status for r in results if r] == ["done", "done", "done", "cancelled", "done"]
    steering = [e for e in client.events_so_far(info.runs[2]) if e.type == "STEERED"]
    assert [e.data["text"] for e in steering] == ["also db-2"]


@pytest.fixture(scope="module")
def chat_asker(fleet) -> Iterator[str]:
    name = "chat-asker"
    fleet.start_machine(
        name, {"CMDOP_PERMISSION_MODE": "default", "CMDOP_APPROVAL_TIMEOUT_S": "60"}
    )
    try:
        fleet.wait_ready(["alpha", "beta", name], timeout_s=60)
        yield name
    finally:
        fleet.workers.pop(name).stop()


@pytest.mark.skipif(TMUX is None and not os.environ.get("CI"), reason="tmux not installed")
def test_approvals_answered_inline_with_edit_approve_and_deny(
    chat_env, script, client, tmp_path, chat_asker
) -> None:
    assert TMUX is not None, "CI installs tmux (.ci/run)"
    original, edited, never = (tmp_path / name for name in ("original", "edited", "never"))
    prompt = script(
        [
            [tool(chat_asker, f"touch {original}")],
            [tool(chat_asker, "echo approved-b")],
            [tool(chat_asker, f"touch {never}")],
            text("model saw: {{result:0}}"),
        ]
    )
    edit = json.dumps({"machine": chat_asker, "command": f"touch {edited}"})
    screen = TmuxScreen(TMUX, tmp_path, chat_env)
    try:
        screen.start(f"{CLI} chat --machine {chat_asker}; echo CHAT-EXIT=$?", rows=150)
        screen.wait_for(lambda s: "Ctrl-D leaves" in s)
        typed(screen, prompt)
        screen.wait_for(lambda s: s.count("needs approval") == 1)
        typed(screen, f"/edit {edit}")
        screen.wait_for(lambda s: s.count("needs approval") == 2)
        typed(screen, "/approve")
        screen.wait_for(lambda s: "approved-b" in s and s.count("needs approval") == 3)
        typed(screen, "/deny not on this box")
        final = screen.wait_for(lambda s: "── done" in s)
        screen.send("C-d")
        screen.wait_for(lambda s: "CHAT-EXIT=0" in s)
    finally:
        screen.close()
    assert edited.exists() and not original.exists() and not never.exists()
    assert "model saw: permission denied by a person" in final and "not on this box" in final
    run_id = next(line.split()[-1] for line in final.splitlines() if line.startswith("> run "))
    resolved = [e.data for e in client.events_so_far(run_id) if e.type == "APPROVAL_RESOLVED"]
    assert [d["verdict"] for d in resolved] == ["approved", "approved", "denied"]
    assert resolved[0]["input"] == json.loads(edit) and resolved[2]["reason"] == "not on this box"


@pytest.mark.skipif(TMUX is None and not os.environ.get("CI"), reason="tmux not installed")
def test_an_answer_to_the_model_does_not_approve_the_waiting_call(
    chat_env, script, client, tmp_path, chat_asker
) -> None:
    """The model asks a yes-or-no question while its call waits: the person's "yes" is
    a message to the run, and only /approve runs the call."""
    assert TMUX is not None, "CI installs tmux (.ci/run)"
    marker = tmp_path / "copied"
    prompt = script(
        [
            [*text("Shall I keep a copy first? (yes/no)"), tool(chat_asker, f"touch {marker}")],
            text("copy made: {{result:0}}"),
        ]
    )
    screen = TmuxScreen(TMUX, tmp_path, chat_env)
    try:
        screen.start(f"{CLI} chat --machine {chat_asker}; echo CHAT-EXIT=$?", rows=150)
        screen.wait_for(lambda s: "Ctrl-D leaves" in s)
        typed(screen, prompt)
        asked = screen.wait_for(lambda s: "needs approval" in s)
        run_id = next(line.split()[-1] for line in asked.splitlines() if line.startswith("> run "))
        for n, line in enumerate(["yes please keep a copy", "y", "approve"], start=1):
            typed(screen, line)
            screen.wait_for(lambda s, n=n: s.count("sent as a message; a call still waits") == n)
        events = client.events_so_far(run_id)
        assert not marker.exists()
        assert [e.type for e in events if e.type.startswith("APPROVAL")] == ["APPROVAL_REQUEST"]
        typed(screen, "/approve")
        final = screen.wait_for(lambda s: "copy made:" in s and "── done" in s)
        screen.send("C-d")
        screen.wait_for(lambda s: "CHAT-EXIT=0" in s)
    finally:
        screen.close()
    assert marker.exists() and "✓ execute_command on chat-asker" in final
    assert "↪ steered: yes please keep a copy" in final  # the model got its answer
    resolved = [e.data for e in client.events_so_far(run_id) if e.type == "APPROVAL_RESOLVED"]
    assert [d["verdict"] for d in resolved] == ["approved"]
