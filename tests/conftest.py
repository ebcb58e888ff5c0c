"""Shared fixtures: a real redis-server, the fake model, and a real worker fleet.

The integration tier starts one private `redis-server` on a free port, the project's
fake Anthropic server, a coordinator and machine workers `alpha` and `beta` as
subprocesses, once per session. Tests isolate themselves by run id (and scripts by
name), never by flushing Redis under live workers. Timings are compressed through
settings (retry backoff, approval timeout, watchdog interval), never by a fake clock
inside the workers.

Guards: every process is pointed at the fake server, and in this process any attempt
to resolve the real Anthropic API's host fails the test.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.models import Event
from cmdop_worker.runtime import Runtime
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from tests.harness import TurnHarness

MACHINES = ("alpha", "beta")
_real_getaddrinfo = socket.getaddrinfo


def _guarded_getaddrinfo(host: object, *args: object, **kwargs: object) -> object:
    if isinstance(host, str) and host.endswith("anthropic.com"):
        raise AssertionError(f"a test tried to reach the real Anthropic API ({host})")
    return _real_getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]


socket.getaddrinfo = _guarded_getaddrinfo  # type: ignore[assignment]
for _name in list(os.environ):
    if _name.startswith("CMDOP_") or _name.startswith("ANTHROPIC_"):
        del os.environ[_name]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fake_model() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as fake:
        yield fake


@pytest.fixture(scope="session")
def fleet_env(
    redis_server: RedisServer, fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    workdir = tmp_path_factory.mktemp("fleet")
    return {
        "CMDOP_REDIS_URL": redis_server.url,
        "ANTHROPIC_BASE_URL": fake_model.url,
        "ANTHROPIC_API_KEY": "sk-test-secret-do-not-leak",
        "CMDOP_PERMISSION_MODE": "bypass",
        # Tools see the machine's mark (their environment is otherwise an allowlist).
        "CMDOP_TOOL_ENV": "CMDOP_TEST_MACHINE_MARK",
        "CMDOP_POLICY_FILE": str(repo_root() / "tests" / "writable_tmp.toml"),
        "CMDOP_AUDIT_LOG": str(workdir / "audit.log"),
        "CMDOP_LLM_BACKOFF_BASE_S": "0.02",
        "CMDOP_LLM_BACKOFF_MAX_S": "0.2",
        "CMDOP_APPROVAL_TIMEOUT_S": "2",
        "CMDOP_TOOL_GRACE_MS": "1500",
        "CMDOP_PRESENCE_TTL_S": "2",
        "CMDOP_PRESENCE_REFRESH_S": "0.5",
        "CMDOP_WATCHDOG_INTERVAL_S": "0.05",
        "CMDOP_VISIBILITY_TIMEOUT_S": "30",
        "CMDOP_WORKER_CONCURRENCY": "8",
        "CMDOP_AGENTS_FILE": str(repo_root() / "config" / "agents.example.toml"),
        "CMDOP_HIDE_MAP_FILE": str(repo_root() / "config" / "hide_map.example.toml"),
    }


@pytest.fixture(scope="session")
def fleet(
    fleet_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalFleet]:
    local = LocalFleet(fleet_env, logdir=tmp_path_factory.mktemp("logs"))
    try:
        local.start_coordinator()
        for machine in MACHINES:
            local.start_machine(machine, {"CMDOP_TEST_MACHINE_MARK": f"mark-{machine}"})
        local.wait_ready(MACHINES, timeout_s=60)
        yield local
    finally:
        local.stop()


@pytest.fixture
def settings(fleet_env: dict[str, str]) -> Settings:
    return Settings(redis_url=fleet_env["CMDOP_REDIS_URL"], approval_timeout_s=2)


@pytest.fixture
def client(fleet: LocalFleet, settings: Settings) -> Iterator[Client]:
    with Client(settings) as c:
        yield c


@pytest.fixture
def rt(fleet: LocalFleet, settings: Settings) -> Iterator[Runtime]:
    """The coordinator's runtime on the session fleet's Redis, in this process: for tests
    that drive a turn's parts directly (the session fleet's workers run beside it)."""
    runtime = Runtime(settings)
    yield runtime
    runtime.close()


@pytest.fixture
def script(fake_model: FakeAnthropic) -> ScriptFactory:
    return ScriptFactory(fake_model)


class ScriptFactory:
    """Registers a uniquely named script and gives the prompt that selects it."""

    def __init__(self, fake: FakeAnthropic) -> None:
        self.fake = fake

    def __call__(self, turns: list[object], **options: object) -> str:
        name = f"t{uuid.uuid4().hex[:12]}"
        self.fake.add_script(name, {"turns": turns, **options})
        return f"[[script:{name}]] please"

    def requests_for(self, prompt: str) -> list[dict[str, object]]:
        """The recorded requests of the runs started with `prompt`, oldest first."""
        found = []
        for rec in self.fake.requests():
            messages = rec["body"].get("messages", [])
            first = messages[0]["content"] if messages else ""
            text = first if isinstance(first, str) else " ".join(b.get("text", "") for b in first)
            if prompt in text:
                found.append(rec)
        return found


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def isolated_env(redis_url: str, fake: FakeAnthropic, **extra: str) -> dict[str, str]:
    """The environment of a test fleet of its own: its Redis, the shared fake model,
    presence and the watchdog fast enough for tests, then `extra` (CMDOP_ names)."""
    return {
        "CMDOP_REDIS_URL": redis_url,
        "ANTHROPIC_BASE_URL": fake.url,
        "CMDOP_PRESENCE_TTL_S": "2",
        "CMDOP_PRESENCE_REFRESH_S": "0.5",
        "CMDOP_WATCHDOG_INTERVAL_S": "0.05",
        "CMDOP_MAX_TURNS": "3",
        **{f"CMDOP_{name.upper()}": value for name, value in extra.items()},
    }


@dataclass
class PolicyBase:
    """A Redis with a password and a coordinator; machines come and go on it (`machines`)."""

    server: RedisServer
    fleet: LocalFleet

    @contextmanager
    def machines(
        self,
        work: Path,
        policies: dict[str, str],
        machine_env: dict[str, dict[str, str]] | None = None,
    ) -> Iterator[Client]:
        """One machine per policy text (`{name: TOML}`, written under `work`), each with
        `machine_env`'s extra variables, for the `with` block; yields a client."""
        started = []
        try:
            for machine, body in policies.items():
                policy = work / f"{machine}.toml"
                policy.write_text(body)
                extra = (machine_env or {}).get(machine, {})
                self.fleet.start_machine(machine, {"CMDOP_POLICY_FILE": str(policy), **extra})
                started.append(machine)
            self.fleet.wait_ready(started, timeout_s=60)
            with Client(Settings(redis_url=self.server.url)) as client:
                yield client
        finally:
            for machine in started:
                self.fleet.workers.pop(machine).stop()


@contextmanager
def policy_base(fake: FakeAnthropic, logs: Path, **settings: str) -> Iterator[PolicyBase]:
    """A fleet's base of its own: a Redis with a password and a coordinator, with
    `settings` as `isolated_env` takes them. Several modules may share one."""
    server = RedisServer(password=f"fleet-{uuid.uuid4().hex[:12]}").start()
    fleet = LocalFleet(isolated_env(server.url, fake, **settings), logdir=logs)
    try:
        fleet.start_coordinator()
        yield PolicyBase(server, fleet)
    finally:
        fleet.stop()
        server.stop()


def run_tool_calls(
    client: Client, fake: FakeAnthropic, machine: str, uses: list[dict[str, Any]], **fields: Any
) -> list[Event]:
    """One run on `machine` whose scripted model makes every call of `uses` in one turn
    (`{"name": TOOL, "input": {...}}`), then ends; its TOOL_ENDs in call order."""
    name = f"calls{uuid.uuid4().hex[:10]}"
    blocks = [{"type": "tool_use", **use} for use in uses]
    done = {"type": "text", "text": "done"}
    fake.add_script(name, [[{"type": "text", "text": "on it"}, *blocks], [done]])
    run = client.submit(prompt=f"[[script:{name}]] go", machine=machine, timeout_s=120, **fields)
    result = run.wait(timeout=150)
    assert result.status == "done", result
    ends = {e.data["tool_call_id"]: e for e in run.events() if e.type == "TOOL_END"}
    ids = [
        block["id"]
        for message in result.messages
        if message.role == "assistant" and isinstance(message.content, list)
        for block in message.content
        if block.get("type") == "tool_use"
    ]
    return [ends[i] for i in ids]


@pytest.fixture(scope="session")
def _turn_harness(redis_server: RedisServer, fake_model: FakeAnthropic) -> Iterator[TurnHarness]:
    harness = TurnHarness(redis_server.url, fake_model.url)
    yield harness
    harness.close()


@pytest.fixture
def turn_harness(_turn_harness: TurnHarness) -> Iterator[TurnHarness]:
    """A coordinator in this process on the session Redis, under a prefix of its own,
    with no worker (`tests.harness`): one for the session, as the fleet has one
    coordinator. Its `client` drains it whenever it reads; whatever a test left queued
    runs when the test ends, not in the next one."""
    yield _turn_harness
    _turn_harness.drain()
