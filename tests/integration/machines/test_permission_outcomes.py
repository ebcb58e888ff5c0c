"""Permissions on the isolated fleet's machines (`iso`, one per mode): each verdict,
its audit line, an ask answered through the CLI or the client, and nobody answering."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Run

from .machine_runs import (
    NO_ANSWER_WAIT_S,
    calls_then_report,
    cli,
    finish,
    use,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("machine", "tool", "tool_input", "status", "verdict", "source", "final"),
    [
        ("p-bypass", "read_file", {"path": "{dir}/.env"}, "denied", "deny", "floor", "deny"),
        ("p-bypass", "execute_command", {"command": "rm -rf /"}, "denied", "deny", "floor", "deny"),
        (
            "p-bypass",
            "execute_command",
            {"command": "echo forbidden-x"},
            "denied",
            "deny",
            "rule",
            "deny",
        ),
        (
            "p-bypass",
            "execute_command",
            {"command": "echo bypassed"},
            "ok",
            "allow",
            "mode",
            "allow",
        ),
        (
            "p-strict",
            "execute_command",
            {"command": "echo strict-no-rule"},
            "denied",
            "deny",
            "mode",
            "deny",
        ),
        (
            "p-strict",
            "execute_command",
            {"command": "echo allowed-here"},
            "ok",
            "allow",
            "rule",
            "allow",
        ),
        ("p-strict", "read_file", {"path": "{dir}/plain.txt"}, "ok", "allow", "rule", "allow"),
    ],
)
def test_permission_outcome_and_audit_line(
    iso, script, host_dir, machine, tool, tool_input, status, verdict, source, final
) -> None:
    (host_dir / ".env").write_text("SECRET=do-not-show\n")
    (host_dir / "plain.txt").write_text("plain words\n")
    tool_input = {k: v.replace("{dir}", str(host_dir)) for k, v in tool_input.items()}
    prompt = script(calls_then_report(use(tool, machine=machine, **tool_input)))
    done = finish(iso.client, prompt)
    assert done.result.status == "done"
    (end,) = done.ends
    assert end.data["status"] == status, end.data
    assert "do-not-show" not in end.data["output"]
    if status == "denied":
        assert end.data["output"].startswith("permission denied: ")
    line = iso.audit(machine, done.run.run_id, end.data["tool_call_id"])
    assert (line["verdict"], line["source"], line["final"]) == (verdict, source, final)
    assert line["tool"] == tool and line["machine"] == machine


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A directory the machines' sandboxes see (their /tmp is private)."""
    path = Path(f"/var/tmp/cmdop-iso-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _ask_and_answer(iso, script, machine: str, command: str, answer: Callable[[Run, str], None]):
    prompt = script(calls_then_report(use("execute_command", machine=machine, command=command)))
    asked: list[Event] = []

    def on_event(run: Run, event: Event) -> None:
        if event.type == "APPROVAL_REQUEST":
            asked.append(event)
            answer(run, event.data["tool_call_id"])

    done = finish(iso.client, prompt, on_event)
    assert len(asked) == 1 and asked[0].data["machine"] == machine
    (end,) = done.ends
    return done, end, iso.audit(machine, done.run.run_id, end.data["tool_call_id"])


def test_ask_rule_approved_through_the_cli_runs_the_call(iso, script) -> None:
    def approve_with_cli(run: Run, tool_call_id: str) -> None:
        out = cli(
            {"CMDOP_REDIS_URL": iso.env["CMDOP_REDIS_URL"]}, "approve", run.run_id, tool_call_id
        )
        assert out.returncode == 0, out.stderr

    done, end, line = _ask_and_answer(iso, script, "p-ask", "echo ask-me please", approve_with_cli)
    assert end.data["status"] == "ok" and "ask-me please" in end.data["output"]
    assert (line["verdict"], line["source"], line["final"]) == ("ask", "rule", "approved")
    assert done.result.status == "done"


def test_ask_rule_denied_by_the_client_is_refused(iso, script) -> None:
    def deny(run: Run, tool_call_id: str) -> None:
        run.approve(tool_call_id, approve=False)

    _, end, line = _ask_and_answer(iso, script, "p-ask", "echo ask-me twice", deny)
    assert end.data["status"] == "denied"
    assert end.data["output"].startswith("permission denied by a person")
    assert (line["verdict"], line["source"], line["final"]) == ("ask", "rule", "denied")


def test_mode_default_asks_and_nobody_answering_denies(iso, script) -> None:
    def ignore(run: Run, tool_call_id: str) -> None:
        pass

    done, end, line = _ask_and_answer(iso, script, "p-default", "echo nobody-home", ignore)
    assert end.data["status"] == "denied"
    assert end.data["output"] == f"permission denied: nobody approved within {NO_ANSWER_WAIT_S:g} s"
    assert (line["verdict"], line["source"], line["final"]) == ("ask", "mode", "timeout")
    (asked,) = done.of("APPROVAL_REQUEST")
    assert asked.data["timeout_s"] == NO_ANSWER_WAIT_S
