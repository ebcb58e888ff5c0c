"""Operators watch the fleet in Flower: names, short arguments, no secrets, every worker.

A real Flower process is started after the fleet's workers and before the run, as an
operator would; its REST API is read the way a dashboard would read it, and used the
way a service would start a run through it. Flower started by the README's own command
listens on loopback only. Also checks that the workers' own log lines name the run,
turn, tool and machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import free_port
from tests.conftest import repo_root
from tests.net import connects, http_status, listening_addresses, own_public_address
from tests.procs import sleeper, wait_for, wait_for_sleeper

pytestmark = pytest.mark.e2e

SECRET = "sk-test-secret-do-not-leak"


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def poll(what: str, check: Any, timeout_s: float = 20.0) -> Any:
    """`wait_for`, counting a refused or failed HTTP request as "not yet"."""

    def attempt() -> Any:
        try:
            return check()
        except OSError:
            return None

    return wait_for(attempt, timeout_s, what)


@pytest.fixture(scope="module")
def flower(fleet, fleet_env, tmp_path_factory) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, **fleet_env, "FLOWER_UNAUTHENTICATED_API": "true"}
    argv = [sys.executable, "-m", "celery", "-A", "cmdop_worker.celery_app", "flower"]
    argv += [f"--port={port}", "--address=127.0.0.1"]
    url = f"http://127.0.0.1:{port}"
    with _running(argv, env, tmp_path_factory.mktemp("flower") / "flower.log"):
        poll("flower's healthcheck", lambda: _ok(f"{url}/healthcheck"), timeout_s=30)
        _await_events(url, fleet_env)
        yield url


@contextlib.contextmanager
def _running(argv: list[str], env: dict[str, str], log: Path) -> Iterator[None]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _await_events(url: str, fleet_env: dict[str, str]) -> None:
    """The workers send no task events until a monitor asks: wait until Flower has
    asked (on start, then every 5 s) and sees the tasks of a probe run."""
    with Client(Settings(redis_url=fleet_env["CMDOP_REDIS_URL"])) as client:

        def probe_seen() -> bool:
            run = client.submit(prompt="probe")
            run.wait(timeout=30)
            time.sleep(0.5)
            tasks = get_json(f"{url}/api/tasks")
            return any(tid.startswith(run.run_id) for tid in tasks)

        poll("flower to turn task events on", probe_seen, timeout_s=40)


def _ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status == 200


def test_flower_lists_every_machine_worker(flower) -> None:
    workers = poll(
        "alpha and beta in /api/workers",
        lambda: _names_if_all(get_json(f"{flower}/api/workers?refresh=1")),
    )
    assert any(name.startswith("coordinator-") for name in workers)


def _names_if_all(workers: dict[str, Any]) -> list[str] | None:
    names = list(workers)
    prefixes = {name.split("@")[0] for name in names}
    return names if {"alpha", "beta"} <= prefixes else None


def test_flower_shows_a_runs_tasks_by_name_with_short_safe_arguments(
    flower, client, script, fleet
) -> None:
    calls = [
        {"type": "tool_use", "name": "execute_command", "input": {"machine": m, "command": "true"}}
        for m in ("alpha", "beta")
    ]
    prompt = script([calls, [{"type": "text", "text": "both fine"}]])
    run = client.submit(prompt=prompt + " " + "padding " * 200, machine="alpha")
    assert run.wait(timeout=30).text == "both fine"

    def run_tasks() -> dict[str, Any] | None:
        tasks = get_json(f"{flower}/api/tasks")
        mine = {tid: t for tid, t in tasks.items() if tid.startswith(run.run_id)}
        names = sorted(t["name"] for t in mine.values() if t.get("state") == "SUCCESS")
        expected = ["cmdop.run", "cmdop.tool", "cmdop.tool", "cmdop.turn", "cmdop.turn"]
        return {"tasks": tasks, "mine": mine} if names == expected else None

    seen = poll("the run's five tasks in /api/tasks", run_tasks)
    assert SECRET not in json.dumps(seen["tasks"])
    by_name: dict[str, list[dict[str, Any]]] = {}
    for task in seen["mine"].values():
        by_name.setdefault(task["name"], []).append(task)

    (start,) = by_name["cmdop.run"]
    assert run.run_id in start["kwargs"] and "'machine': 'alpha'" in start["kwargs"]
    assert len(start["kwargs"]) < 300, start["kwargs"]  # the prompt is shortened
    for turn in by_name["cmdop.turn"]:
        assert run.run_id in turn["args"]
    tools = by_name["cmdop.tool"]
    for tool in tools:
        assert run.run_id in tool["kwargs"] and "'tool': 'execute_command'" in tool["kwargs"]
        assert "'turn': 1" in tool["kwargs"]
    assert {t["worker"].split("@")[0] for t in tools} == {"alpha", "beta"}
    assert sorted("alpha" in t["kwargs"] for t in tools) == [False, True]


def test_flower_exports_prometheus_metrics(flower) -> None:
    with urllib.request.urlopen(f"{flower}/metrics", timeout=10) as response:
        assert b"flower_events_total" in response.read()


def test_worker_log_lines_name_run_turn_tool_and_machine(client, script, fleet) -> None:
    call = {"type": "tool_use", "name": "execute_command", "input": {"command": "true"}}
    prompt = script([[call], [{"type": "text", "text": "ok"}]])
    run = client.submit(prompt=prompt, machine="beta")
    run.wait(timeout=30)
    tool_lines = _lines_with(fleet.workers["beta"].log_path, run.run_id)
    assert any("turn=1 tool=execute_command machine=beta" in line for line in tool_lines)
    turn_lines = _lines_with(fleet.workers["coordinator"].log_path, run.run_id)
    assert any(f"run={run.run_id} turn=2 tool=-" in line for line in turn_lines), turn_lines


def _lines_with(path: Path, run_id: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if f"run={run_id}" in line]


def test_a_cancelled_or_denied_tool_is_revoked_in_flower_not_a_success(
    flower, client, script, fleet
) -> None:
    command = sleeper(60)
    calls = [
        _call("execute_command", machine="beta", command=command),
        _call("read_file", machine="alpha", path="/tmp/x/.env"),  # behind the floor
    ]
    prompt = script([calls, [{"type": "text", "text": "never"}]])
    run = client.submit(prompt=prompt, machine="alpha")
    wait_for_sleeper(command)
    assert run.cancel(ui=True)
    assert run.wait(timeout=15, raise_on_failure=False).status == "cancelled"

    def tool_states() -> dict[str, str] | None:
        tasks = get_json(f"{flower}/api/tasks")
        mine = [t for tid, t in tasks.items() if tid.startswith(run.run_id)]
        states = {t["kwargs"]: t["state"] for t in mine if t["name"] == "cmdop.tool"}
        settled = len(states) == 2 and "STARTED" not in states.values()
        return states if settled else None

    states = poll("the run's two tool tasks settled in /api/tasks", tool_states)
    assert sorted(states.values()) == ["REVOKED", "REVOKED"], states


def _call(name: str, **tool_input: str) -> dict[str, Any]:
    return {"type": "tool_use", "name": name, "input": tool_input}


def test_a_run_started_through_flowers_rest_api_gets_a_client_shaped_id(
    flower, client, script
) -> None:
    prompt = script([[{"type": "text", "text": "started from flower"}]])
    body = json.dumps({"kwargs": {"request": {"prompt": prompt}}}).encode()
    request = urllib.request.Request(
        f"{flower}/api/task/send-task/cmdop.run",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        task_id = json.loads(response.read())["task-id"]

    def run_id() -> str | None:
        answer = get_json(f"{flower}/api/task/result/{task_id}")
        return answer["result"] if answer.get("state") == "SUCCESS" else None

    started = poll("cmdop.run's result in Flower", run_id)
    assert re.fullmatch(r"[0-9a-f]{32}", started), started  # as `Client.submit` mints them
    assert client.run(started).wait(timeout=30).text == "started from flower"


@pytest.fixture(scope="module")
def readme_flower(fleet_env, tmp_path_factory) -> Iterator[int]:
    """Flower started by the README's command as written, on a free port."""
    (line,) = [
        line
        for line in (repo_root() / "README.md").read_text().splitlines()
        if line.startswith("celery -A cmdop_worker.celery_app flower")
    ]
    words = shlex.split(line)
    port = free_port()
    argv = [sys.executable, "-m", *words, f"--port={port}"]
    env = {**os.environ, **fleet_env}
    with _running(argv, env, tmp_path_factory.mktemp("readme-flower") / "flower.log"):
        poll("flower's healthcheck", lambda: _ok(f"http://127.0.0.1:{port}/healthcheck"))
        yield port


def test_flower_as_the_readme_starts_it_listens_on_loopback_only(readme_flower) -> None:
    assert {str(a) for a in listening_addresses(readme_flower)} == {"127.0.0.1"}
    public = own_public_address()
    if public is not None:
        assert not connects(public, readme_flower), f"flower answers on {public}"


def test_flowers_metrics_answer_without_auth_as_documented(readme_flower) -> None:
    """Flower 2.2 has no way to put /metrics behind its auth (docs/operations.md)."""
    url = f"http://127.0.0.1:{readme_flower}"
    assert http_status(f"{url}/api/workers") == 401
    assert http_status(f"{url}/api/workers", "admin:secret") == 200
    assert http_status(f"{url}/metrics") == 200
    assert http_status(f"{url}/healthcheck") == 200
