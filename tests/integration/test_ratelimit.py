"""The fleet's rate limiter: its Lua script on a real Redis, and model clients sharing it.

Two `AnthropicModel`s with their own SDK clients and connections, sharing only Redis,
stand for two coordinators: what one learns from the fake server (a real HTTP server,
reached by the real SDK) holds the other back. Each test has its own key prefix.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import redis

from cmdop_worker.config import Settings
from cmdop_worker.core.ratelimit import Allowance, Cost, limiter_scope, pace_ms
from cmdop_worker.errors import ModelError, StopNow
from cmdop_worker.llm.client import AnthropicModel, RetryNotice
from cmdop_worker.llm.limiter import fleet_limiter
from cmdop_worker.models import CancelRequest
from cmdop_worker.state.cancel import CancelWatch
from cmdop_worker.state.connect import redis_client
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.ratelimit import RateLimits
from cmdop_worker.surfaces.fleet import RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
COST = Cost(1, 100, 100)
KEY = "sk-test-not-a-key"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture(autouse=True)
def _reset(fake: FakeAnthropic) -> None:
    fake.reset()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_client(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:8]}:")


def redis_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


@pytest.fixture(autouse=True)
def _close_models() -> Iterator[None]:
    """Each test's model clients closed with it: a client left to the garbage collector
    closes its pooled sockets with a ResourceWarning, in whichever test runs then."""
    yield
    while Coordinator.opened:
        Coordinator.opened.pop().model.close()


class Coordinator:
    """One coordinator's model client, with the fleet's limiter in the shared Redis."""

    opened: ClassVar[list[Coordinator]] = []

    def __init__(self, fake: FakeAnthropic, client: redis.Redis, keys: Keys) -> None:
        Coordinator.opened.append(self)
        self.settings = Settings(
            anthropic_base_url=fake.url,
            anthropic_api_key=KEY,
            llm_backoff_base_s=0.02,
            llm_backoff_max_s=5.0,
        )
        self.sleeps: list[float] = []
        self.notices: list[RetryNotice] = []
        self.model = AnthropicModel(
            self.settings,
            sleep=self._sleep,
            limiter=fleet_limiter(self.settings, client, keys),
        )

    def _sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        time.sleep(seconds)

    def call(
        self, model: str = "m", *, watch: CancelWatch | None = None, deadline_in_s: float = 30
    ) -> Any:
        request = {
            "model": model,
            "max_tokens": 50,
            "messages": [{"role": "user", "content": f"hello {uuid.uuid4().hex}"}],
        }
        return self.model.complete(
            request,
            stream=True,
            emit=lambda kind, text: None,
            watch=watch,
            deadline_s=time.monotonic() + deadline_in_s,
            on_retry=self.notices.append,
        )

    def causes(self) -> list[str]:
        return [n.cause for n in self.notices]


def statuses(fake: FakeAnthropic) -> list[int]:
    found = []
    for rec in fake.requests():
        fault = (rec["response"] or {}).get("fault") or {}
        found.append(int(fault.get("status", 200)))
    return found


# --- the script -------------------------------------------------------------------------


def test_a_first_call_probes_alone_and_an_endpoint_without_limits_is_let_through(
    r: redis.Redis, keys: Keys
) -> None:
    limits = RateLimits(r, keys)
    first = limits.acquire("s", COST)
    assert first.reason == "probe" and first.wait_ms == 0  # it goes, as the probe
    held = limits.acquire("s", COST)
    assert held.reason == "probe" and held.wait_ms > 0
    limits.learn("s", {}, pause_ms=None)  # its response stated no limits
    assert [limits.acquire("s", COST).reason for _ in range(5)] == ["go"] * 5


def test_the_first_slot_after_the_probe_is_a_pace_after_it(r: redis.Redis, keys: Keys) -> None:
    limits = RateLimits(r, keys)
    assert limits.acquire("s", COST).reason == "probe"
    limits.learn("s", {"requests": Allowance(300, 299, 200.0)}, pause_ms=None)
    after = limits.acquire("s", COST)
    assert after.reason == "pace"  # the probe counts toward the second it went in
    assert pace_ms(200.0) - 50 <= after.wait_ms <= pace_ms(200.0)


def test_slots_are_handed_out_one_pace_apart_however_full_the_bucket(
    r: redis.Redis, keys: Keys
) -> None:
    limits = RateLimits(r, keys)
    # 5 a window, 4 left, full again in 200 ms: one request comes back every 200 ms.
    limits.learn("s", {"requests": Allowance(5, 4, 200.0)}, pause_ms=None)
    grants = [limits.acquire("s", COST) for _ in range(10)]
    waits = [g.wait_ms for g in grants]
    # Room for 3 more in the bucket, but a burst would break the short interval.
    assert grants[0].reason == "go"
    assert all(g.reason == "pace" for g in grants[1:])
    spacing = pace_ms(200.0)
    gaps = [b - a for a, b in itertools.pairwise(waits)]
    assert all(spacing - 2 <= gap <= spacing + 1 for gap in gaps), waits  # nobody shares one
    assert limits.acquire("s", COST, held_epoch=grants[-1].epoch).reason == "go"


def test_the_interval_only_moves_up_until_the_limit_changes(r: redis.Redis, keys: Keys) -> None:
    limits = RateLimits(r, keys)
    limits.learn("s", {"requests": Allowance(5, 4, 150.0)}, pause_ms=None)
    assert limits.snapshot("s")["r:t"] == pytest.approx(150)
    limits.learn("s", {"requests": Allowance(5, 4, 190.0)}, pause_ms=None)
    limits.learn("s", {"requests": Allowance(5, 4, 40.0)}, pause_ms=None)  # a lower bound
    assert limits.snapshot("s")["r:t"] == pytest.approx(190)
    limits.learn("s", {"requests": Allowance(10, 9, 100.0)}, pause_ms=None)  # a new limit
    assert limits.snapshot("s")["r:t"] == pytest.approx(100)
    limits.learn("s", {"requests": Allowance(60, 60, 0.0)}, pause_ms=None)  # nothing to go by
    assert limits.snapshot("s")["r:t"] == pytest.approx(1000)  # per minute, a guess
    limits.learn("s", {"requests": Allowance(60, 59, 20.0)}, pause_ms=None)
    assert limits.snapshot("s")["r:t"] == pytest.approx(20)  # a reading replaces a guess


def test_a_response_learnt_with_its_calls_correction_settles_it_too(
    r: redis.Redis, keys: Keys
) -> None:
    limits = RateLimits(r, keys)
    limits.learn("s", {"input_tokens": Allowance(1000, 500, 5000.0)}, pause_ms=None)
    full_at = limits.snapshot("s")["i:tat"]
    limits.learn(
        "s",
        {"input_tokens": Allowance(1000, 500, 5000.0)},
        pause_ms=None,
        correction=Cost(0, -40, 0),
    )
    assert limits.snapshot("s")["i:tat"] == pytest.approx(full_at - 40 * 10, abs=50)


def test_a_pause_voids_slots_reserved_before_it_and_refills_one_at_a_time(
    r: redis.Redis, keys: Keys
) -> None:
    limits = RateLimits(r, keys)
    limits.learn("s", {"requests": Allowance(5, 0, 1000.0)}, pause_ms=None)
    paced = limits.acquire("s", COST)
    assert paced.reason == "pace"
    limits.learn("s", {}, pause_ms=300)  # another coordinator got a 429
    again = limits.acquire("s", COST, held_epoch=paced.epoch)
    assert again.reason == "pause" and again.epoch == paced.epoch + 1
    assert 250 <= again.wait_ms <= 300
    state = limits.snapshot("s")
    # Right after the pause one slot, then one per interval (200 ms): no burst.
    assert state["r:tat"] - state["pause"] == pytest.approx(3 * 200)
    assert state["r:pace"] == state["pause"]  # the slots reserved before it are void


def test_the_providers_view_only_moves_a_bucket_later(r: redis.Redis, keys: Keys) -> None:
    limits = RateLimits(r, keys)
    limits.learn("s", {"requests": Allowance(100, 50, 5000.0)}, pause_ms=None)
    full_at = limits.snapshot("s")["r:tat"]
    limits.learn("s", {"requests": Allowance(100, 99, 10.0)}, pause_ms=None)
    assert limits.snapshot("s")["r:tat"] == full_at
    limits.settle("s", Cost(-10, 0, 0))  # ten slots given back
    assert limits.snapshot("s")["r:tat"] == pytest.approx(full_at - 10 * 100)


# --- model clients sharing it -------------------------------------------------------------


def test_a_429_seen_by_one_coordinator_pauses_anothers_call_to_that_model(
    fake: FakeAnthropic, r: redis.Redis, keys: Keys
) -> None:
    first, second = Coordinator(fake, r, keys), Coordinator(fake, r, keys)
    fake.inject({"status": 429, "retry_after_s": 1})
    worker = threading.Thread(target=first.call)
    worker.start()
    give_up = time.monotonic() + 10
    while 429 not in statuses(fake):
        assert time.monotonic() < give_up
        time.sleep(0.005)
    assert second.call(model="another-model").text  # another model is not held back
    assert second.causes() == []
    assert second.call().text
    worker.join()
    assert statuses(fake).count(429) == 1  # the second coordinator never met the limit
    assert second.causes()[0].startswith("rate_limit_wait: m (pause)")
    assert not any("429" in cause for cause in second.causes())
    assert "http_429" in first.causes()[0]


def test_a_ui_cancel_ends_a_wait_for_the_limiter_at_once(
    fake: FakeAnthropic, r: redis.Redis, keys: Keys
) -> None:
    coordinator = Coordinator(fake, r, keys)
    limits = RateLimits(r, keys)
    scope = limiter_scope(endpoint=fake.url, api_key=KEY, model="m")
    limits.learn(scope, {}, pause_ms=30_000)  # another coordinator's 429
    hub = SimpleNamespace(clock_ms=lambda: 0)
    watch = CancelWatch(hub, "run", deadline_ms=10**15, read_now=False)  # type: ignore[arg-type]

    def cancel_when_waiting(notice: RetryNotice) -> None:
        coordinator.notices.append(notice)
        threading.Thread(target=watch.offer, args=(CancelRequest(channel="ui"),)).start()

    request = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(StopNow):
        coordinator.model.complete(
            request,
            stream=True,
            emit=lambda kind, text: None,
            watch=watch,
            deadline_s=time.monotonic() + 60,
            on_retry=cancel_when_waiting,
        )
    assert coordinator.causes() == ["rate_limit_wait: m (pause)"]
    assert fake.requests() == []
    assert limits.snapshot(scope)["pause"] > redis_ms(r)  # cut short, not waited out


def test_a_wait_past_the_runs_deadline_is_not_begun(
    fake: FakeAnthropic, r: redis.Redis, keys: Keys
) -> None:
    coordinator = Coordinator(fake, r, keys)
    limits = RateLimits(r, keys)
    scope = limiter_scope(endpoint=fake.url, api_key=KEY, model="m")
    limits.learn(scope, {}, pause_ms=30_000)
    with pytest.raises(ModelError) as failed:
        coordinator.call(deadline_in_s=3)
    assert failed.value.kind == "deadline"
    assert coordinator.sleeps == [] and fake.requests() == []


@pytest.mark.parametrize(
    "limit",
    [
        {"requests": 5, "window_s": 1},  # a bucket of 5, one back every 200 ms
        {"requests": 300, "short_interval_s": 1},  # 300 a minute, at most 5 in any second
    ],
    ids=["bucket", "per-second"],
)
def test_a_fleet_keeps_to_the_fakes_limit(
    fake: FakeAnthropic, r: redis.Redis, keys: Keys, limit: dict[str, float]
) -> None:
    fake.set_rate_limit(**limit)
    coordinators = [Coordinator(fake, r, keys) for _ in range(3)]
    threads = [threading.Thread(target=coordinators[i % 3].call) for i in range(15)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answered = statuses(fake)
    assert answered.count(200) == 15
    assert answered.count(429) <= 1, answered
    waits = [c for co in coordinators for c in co.causes() if c.startswith("rate_limit_wait")]
    assert waits  # 15 calls at 5 a second: most of them waited for their slot
