"""A fleet under the provider's limits: one shared rate limiter, model fallback.

A private fleet of 4 coordinators (their own redis-server) calling a fake server of
its own that allows 5 requests per second per model and answers a 429 (with
`retry-after`) beyond it, as the API does, with the `anthropic-ratelimit-*` headers on
every response; and one that allows 300 a minute but at most 5 in any second. 40 runs
at once all end `DONE` with far fewer 429s than runs; a 429
pauses a model for the fleet, and a ui cancel or the run's deadline ends a run waiting
on that pause; an agent with fallback models answers through them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.core.ratelimit import limiter_scope
from cmdop_worker.models import Event, RunResult
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.ratelimit import RateLimits
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import isolated_env, repo_root

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

COORDINATORS = 4
RUNS = 40
KEY = "sk-test-secret-do-not-leak"
SONNET, OPUS = "claude-sonnet-5-5", "claude-opus-5-5"


@dataclass
class Limited:
    fleet: LocalFleet
    client: Client
    fake: FakeAnthropic
    server: RedisServer

    def script(self, turns: list[Any]) -> str:
        name = f"rl{uuid.uuid4().hex[:12]}"
        self.fake.add_script(name, {"turns": turns})
        return f"[[script:{name}]] go"

    def requests_for(self, prompt: str) -> list[dict[str, Any]]:
        return [
            rec
            for rec in self.fake.requests()
            if prompt in str(rec["body"].get("messages", [{}])[0].get("content", ""))
        ]

    def pause_left_ms(self, model: str) -> float:
        """How long the fleet's pause of `model` still holds, by Redis's clock."""
        scope = limiter_scope(endpoint=self.fake.url, api_key=KEY, model=model)
        state = RateLimits(self.client.redis, Keys()).snapshot(scope)
        seconds, micros = self.client.redis.time()
        return state.get("pause", 0.0) - (seconds * 1000 + micros / 1000)


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Limited]:
    server = RedisServer().start()
    fake = FakeAnthropic().start()
    fake.set_rate_limit(requests=5, window_s=1)
    env = isolated_env(
        server.url,
        fake,
        llm_backoff_base_s="0.02",
        llm_backoff_max_s="0.2",
        llm_attempts="3",
        worker_concurrency="12",
        agents_file=str(repo_root() / "config" / "agents.example.toml"),
    )
    env["ANTHROPIC_API_KEY"] = KEY
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("limited-logs"))
    client = Client(Settings(redis_url=server.url))
    try:
        for i in range(COORDINATORS):
            fleet.start_coordinator(f"coordinator-{i}")
        fleet.wait_ready((), coordinators=COORDINATORS, timeout_s=60)
        yield Limited(fleet, client, fake, server)
    finally:
        client.close()
        fleet.stop()
        fake.stop()
        server.close()


def events_of(client: Client, run_id: str) -> list[Event]:
    return list(client.events(run_id, idle_timeout_s=30))


def causes(events: list[Event], *, waits: bool = True) -> list[str]:
    found = [str(e.data["cause"]) for e in events if e.type == "RETRY"]
    return found if waits else [c for c in found if not c.startswith("rate_limit_wait")]


def forty_runs_under(limited: Limited, text: str, **limits: Any) -> tuple[list[Any], list[int]]:
    """RUNS one-turn runs at once against the fake's `limits` (its defaults again after
    them, so the next tests' retries never meet these); every run must end DONE. Returns
    the runs and the status each request recorded was answered with."""
    limited.fake.reset()
    limited.fake.set_rate_limit(**limits)
    prompt = limited.script([[{"type": "text", "text": text}]])
    try:
        runs = [limited.client.submit(prompt=f"{prompt} {i}", timeout_s=180) for i in range(RUNS)]
        results: list[RunResult] = [run.wait(timeout=200) for run in runs]
    finally:
        limited.fake.set_rate_limit()
    assert [r.status for r in results] == ["done"] * RUNS, limited.fleet.logs()
    answered = [
        int(((rec["response"] or {}).get("fault") or {}).get("status", 200))
        for rec in limited.fake.requests()
    ]
    assert answered.count(200) == RUNS
    return runs, answered


def test_forty_runs_on_four_coordinators_keep_to_the_providers_limit(limited: Limited) -> None:
    runs, answered = forty_runs_under(limited, "fine", requests=5, window_s=1)
    # Without the limiter 35 of the first 40 requests alone would be refused.
    print(f"\n[limits] {answered.count(429)} 429s for {RUNS} runs")
    assert answered.count(429) <= COORDINATORS, answered
    all_causes = [c for run in runs for c in causes(events_of(limited.client, run.run_id))]
    assert any(c.startswith(f"rate_limit_wait: {SONNET}") for c in all_causes)
    done = [events_of(limited.client, run.run_id)[-1] for run in runs[:3]]
    assert all(e.type == "DONE" and e.data["model"] == SONNET for e in done)


def test_forty_runs_keep_to_a_per_minute_limit_the_provider_enforces_per_second(
    limited: Limited,
) -> None:
    """300 a minute, at most 5 in any second (the headers state only the minute's 300):
    the fleet paces its requests instead of spending the bucket in bursts."""
    _, answered = forty_runs_under(limited, "paced", requests=300, short_interval_s=1)
    # Unpaced, 35 of the first 40 requests would be refused; paced, at most one per
    # coordinator is.
    assert answered.count(429) <= COORDINATORS, answered


def test_an_overloaded_model_falls_back_and_done_names_the_model(limited: Limited) -> None:
    prompt = limited.script(
        [{"content": [{"type": "text", "text": "ok"}], "fault": {"status": 529}}]
    )
    run = limited.client.submit(prompt=prompt, agent="steady", timeout_s=60)
    assert run.wait(timeout=90).status == "done"
    events = events_of(limited.client, run.run_id)
    assert causes(events, waits=False) == [f"fallback:{OPUS} (overloaded on {SONNET}: http_529)"]
    assert events[-1].type == "DONE" and events[-1].data["model"] == OPUS
    assert [rec["body"]["model"] for rec in limited.requests_for(prompt)] == [SONNET, OPUS]


def test_once_a_models_attempts_are_spent_the_next_one_answers(limited: Limited) -> None:
    fault = {"status": 500, "times": 3}  # CMDOP_LLM_ATTEMPTS=3: all of sonnet's
    prompt = limited.script([{"content": [{"type": "text", "text": "ok"}], "fault": fault}])
    run = limited.client.submit(prompt=prompt, agent="steady", timeout_s=60)
    assert run.wait(timeout=90).status == "done"
    events = events_of(limited.client, run.run_id)
    retried = "http_500: api_error: Fake api_error"
    switch = f"fallback:{OPUS} (attempts_spent on {SONNET}: http_500)"
    assert causes(events, waits=False) == [retried, retried, switch]
    assert events[-1].data["model"] == OPUS
    assert [rec["body"]["model"] for rec in limited.requests_for(prompt)] == [SONNET] * 3 + [OPUS]


def paused_run(limited: Limited, model: str, **fields: Any) -> tuple[str, Any]:
    """A run whose first call meets a 429 asking for 30 s: the model pauses for the fleet."""
    fault = {"status": 429, "retry_after_s": 30}
    prompt = limited.script([{"content": [{"type": "text", "text": "late"}], "fault": fault}])
    return prompt, limited.client.submit(prompt=prompt, model=model, **fields)


def test_a_ui_cancel_ends_a_run_waiting_for_the_fleets_pause(limited: Limited) -> None:
    model = f"paused-{uuid.uuid4().hex[:6]}"
    prompt, run = paused_run(limited, model, timeout_s=120)
    for event in run.events(idle_timeout_s=30):
        if event.type == "RETRY" and str(event.data["cause"]).startswith("rate_limit_wait"):
            break
    else:
        pytest.fail("the run never waited for the limiter")
    assert run.cancel(ui=True)
    result = run.wait(timeout=30, raise_on_failure=False)
    assert result.status == "cancelled" and result.cancel is not None
    assert result.cancel.channel == "ui"
    assert len(limited.requests_for(prompt)) == 1  # the 429, and nothing after it
    assert limited.pause_left_ms(model) > 0  # the wait was cut short, not waited out


def test_the_runs_deadline_ends_a_wait_for_the_fleets_pause(limited: Limited) -> None:
    model = f"paused-{uuid.uuid4().hex[:6]}"
    prompt, run = paused_run(limited, model, timeout_s=5)
    result = run.wait(timeout=30, raise_on_failure=False)
    assert result.status == "cancelled" and result.stop_reason == "timeout"
    assert len(limited.requests_for(prompt)) == 1
    assert limited.pause_left_ms(model) > 0
