"""Helpers for the machine tests: scripted calls, a finished run's events, the CLI, and
the isolated fleet's machines (one per permission mode, one that is killed, one with a
user tool). The isolated fleet itself is the package fixture `iso` (conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cmdop_worker.models import Event, RunResult
from cmdop_worker.surfaces.client import Client, Run
from cmdop_worker.surfaces.fleet import LocalFleet

from ...conftest import repo_root

BUILTINS = ["execute_command", "glob", "grep", "list_dir", "read_file", "write_file"]
MARK = "echo $CMDOP_TEST_MACHINE_MARK"


def use(name: str, **tool_input: Any) -> dict[str, Any]:
    return {"type": "tool_use", "name": name, "input": tool_input}


def calls_then_report(*uses: dict[str, Any]) -> list[object]:
    """Turn 1 makes the calls; turn 2 reports every result."""
    return [[{"type": "text", "text": "working"}, *uses], [{"type": "text", "text": "{{results}}"}]]


@dataclass
class Finished:
    run: Run
    result: RunResult
    events: list[Event]

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.type == kind]

    @property
    def ends(self) -> list[Event]:
        return self.of("TOOL_END")

    def ends_in_call_order(self) -> list[Event]:
        """TOOL_END events (which arrive as calls finish) in the order the model made them."""
        by_id = {e.data["tool_call_id"]: e for e in self.ends}
        asked = [
            block["id"]
            for message in self.result.messages
            if message.role == "assistant" and isinstance(message.content, list)
            for block in message.content
            if block.get("type") == "tool_use"
        ]
        return [by_id[i] for i in asked if i in by_id]


OnEvent = Callable[[Run, Event], None]


def finish(client: Client, prompt: str, on_event: OnEvent | None = None, **fields: Any) -> Finished:
    run = client.submit(prompt=prompt, **fields)
    events = []
    for event in run.events(idle_timeout_s=30):
        events.append(event)
        if on_event is not None:
            on_event(run, event)
    result = run.wait(timeout=10, raise_on_failure=False)
    return Finished(run, result, events)


def tool_results(result: RunResult) -> dict[str, dict[str, Any]]:
    """Every tool_result block of the stored history, by tool_use_id."""
    return {
        block["tool_use_id"]: block
        for message in result.messages
        if message.role == "user" and isinstance(message.content, list)
        for block in message.content
        if block.get("type") == "tool_result"
    }


def tool_spec(request: dict[str, Any], name: str) -> dict[str, Any]:
    tools = request["body"]["tools"]
    return next(t for t in tools if t["name"] == name)


def cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cmdop_worker.surfaces.cli", *argv],
        env={**os.environ, **env, "COLUMNS": "250"},
        cwd=repo_root(),
        capture_output=True,
        text=True,
        timeout=60,
    )


POLICY = """\
mode = "default"

[rules]
allow = ["execute_command(echo allowed*)", "read_file", "list_dir"]
ask = ["execute_command(echo ask-me*)"]
deny = ["execute_command(echo forbidden*)"]
"""
ASK_WAIT_S = 20.0  # p-ask: long enough for a person (a CLI subprocess) to answer
NO_ANSWER_WAIT_S = 1.5  # p-default: nobody answers


@dataclass
class Iso:
    fleet: LocalFleet
    client: Client
    env: dict[str, str]
    workdir: Path

    def audit(self, machine: str, run_id: str, tool_use_id: str) -> dict[str, Any]:
        # A wait that expired is audited by its machine once the coordinator tells it,
        # just after the call's outcome: give that line a moment.
        path = self.workdir / f"audit-{machine}.log"
        give_up = time.monotonic() + 10
        while True:
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            found = [x for x in lines if (x["run_id"], x["tool_use_id"]) == (run_id, tool_use_id)]
            if found or time.monotonic() > give_up:
                break
            time.sleep(0.05)
        assert len(found) == 1, found
        return found[0]


def iso_machines(workdir: Path) -> dict[str, dict[str, str]]:
    policy = workdir / "policy.toml"
    policy.write_text(POLICY)

    def machine(name: str, mode: str, **extra: str) -> dict[str, str]:
        return {
            "CMDOP_PERMISSION_MODE": mode,
            "CMDOP_AUDIT_LOG": str(workdir / f"audit-{name}.log"),
            "CMDOP_POLICY_FILE": str(policy),
            **extra,
        }

    return {
        "doomed": machine("doomed", "bypass"),
        "p-ask": machine("p-ask", "default", CMDOP_APPROVAL_TIMEOUT_S=str(ASK_WAIT_S)),
        "p-default": machine("p-default", "default", CMDOP_APPROVAL_TIMEOUT_S="1.5"),
        "p-strict": machine("p-strict", "strict"),
        "p-bypass": machine(
            "p-bypass",
            "bypass",
            CMDOP_TOOL_MODULES='["tests.integration.user_tools"]',
            PYTHONPATH=str(repo_root()),
        ),
    }
