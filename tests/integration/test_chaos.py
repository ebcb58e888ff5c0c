"""Chaos: every run has a random worker SIGKILLed at a random moment; nothing is lost.

A private fleet (its own redis-server, one coordinator, machines `alpha` and `beta`)
with recovery compressed to seconds: a 5 s visibility timeout swept every second, a
2 s lease on turns and watchdog claims, a 2 s presence TTL. Runs go in batches of
several at once; during each batch one worker per run is SIGKILLed (with its whole
process group) at a random moment and restarted at once.

Every tool call appends a marker unique to the call to a side-effect file, so the test
can count how often each really ran. Every run must end with exactly one terminal
event, gap-free `seq`, a valid history, and no call run twice — in particular none
whose outcome was recorded "ok" — and the model is never asked for a turn again unless
a coordinator was killed since it was last asked. The kills are drawn from a seed,
printed at the start; `CHAOS_SEED=<seed>` draws the same ones again (the moments they
hit still depend on the machine's load). Every run of the suite checks 8 runs; the
soak, 24 runs, is marked `soak`: `pytest -m soak` runs it (CI does).
"""

from __future__ import annotations

import collections
import itertools
import os
import random
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.core.history import is_valid_history
from cmdop_worker.models import TERMINAL_EVENTS, RunResult
from cmdop_worker.state.events import read_events
from cmdop_worker.state.keys import COORDINATOR_QUEUE, start_member
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import repo_root

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUNS = 24  # the soak (`pytest -m soak`, run by CI)
SHORT_RUNS = 8  # the same checks in every run of the suite
PARALLEL = 4
KILL_WINDOW_S = 2.0
TARGETS = ("coordinator", "alpha", "beta")


@dataclass
class Chaos:
    fleet: LocalFleet
    client: Client
    fake: FakeAnthropic
    effects: Path
    rng: random.Random
    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    # When each coordinator was dead for sure (ms, the fake model's clock).
    coordinator_deaths: list[float] = field(default_factory=list)

    def restart(self, name: str) -> None:
        self.fleet.workers[name].kill()
        self.kills[name] += 1
        if name == "coordinator":
            self.coordinator_deaths.append(time.monotonic() * 1000)
            self.fleet.start_coordinator()
        else:
            self.fleet.start_machine(name)


@pytest.fixture(scope="module")
def chaos(fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    server = RedisServer().start()
    workdir = tmp_path_factory.mktemp("chaos")
    env = {
        "CMDOP_REDIS_URL": server.url,
        "ANTHROPIC_BASE_URL": fake_model.url,
        "ANTHROPIC_API_KEY": "sk-test-secret-do-not-leak",
        "CMDOP_PERMISSION_MODE": "bypass",
        "CMDOP_POLICY_FILE": str(repo_root() / "tests" / "writable_tmp.toml"),
        "CMDOP_LLM_BACKOFF_BASE_S": "0.02",
        "CMDOP_LLM_BACKOFF_MAX_S": "0.2",
        "CMDOP_TOOL_GRACE_MS": "1500",
        "CMDOP_PRESENCE_TTL_S": "2",
        "CMDOP_PRESENCE_REFRESH_S": "0.5",
        "CMDOP_WATCHDOG_INTERVAL_S": "0.05",
        "CMDOP_VISIBILITY_TIMEOUT_S": "5",
        "CMDOP_BROKER_RESTORE_INTERVAL_S": "1",
        "CMDOP_BROKER_RESTORE_THROTTLE": "1",
        "CMDOP_LEASE_S": "2",
        "CMDOP_WORKER_CONCURRENCY": "8",
    }
    fleet = LocalFleet(env, logdir=workdir / "logs")
    (workdir / "logs").mkdir()
    client = Client(Settings(redis_url=server.url))
    try:
        fleet.start_coordinator()
        for machine in ("alpha", "beta"):
            fleet.start_machine(machine)
        fleet.wait_ready(("alpha", "beta"), timeout_s=60)
        seed = int(os.environ.get("CHAOS_SEED") or time.time())
        print(f"\n[chaos] seed {seed} (CHAOS_SEED={seed} replays its kills)")
        yield Chaos(fleet, client, fake_model, workdir / "effects", random.Random(seed))
    finally:
        client.close()
        fleet.stop()
        server.stop()


def tool_turn(run: str, turn: int, effects: Path) -> list[dict[str, Any]]:
    def call(machine: str) -> dict[str, Any]:
        marker = f"{run}:{turn}:{machine}"
        return {
            "type": "tool_use",
            "name": "execute_command",
            "input": {
                "machine": machine,
                "command": f"echo {marker} >> {effects}; sleep 0.2; echo {marker}",
                "timeout_ms": 3000,
            },
        }

    return [{"type": "text", "text": f"turn {turn}, both machines"}, call("alpha"), call("beta")]


def submit(chaos: Chaos) -> str:
    run = f"chaos{uuid.uuid4().hex[:10]}"
    name = f"s{run}"
    chaos.fake.add_script(
        name,
        {
            "turns": [
                {"content": tool_turn(run, 1, chaos.effects), "latency_ms": 80},
                {"content": tool_turn(run, 2, chaos.effects), "latency_ms": 80},
                [{"type": "text", "text": "all done, nothing lost"}],
            ],
            "token_delay_ms": 15,
        },
    )
    chaos.client.submit(prompt=f"[[script:{name}]] go", run_id=run, timeout_s=90)
    return run


def run_batch(chaos: Chaos, count: int) -> list[str]:
    runs = [submit(chaos) for _ in range(count)]
    started = time.monotonic()
    for offset in sorted(chaos.rng.uniform(0, KILL_WINDOW_S) for _ in runs):
        time.sleep(max(0.0, started + offset - time.monotonic()))
        chaos.restart(chaos.rng.choice(TARGETS))
    return runs


def wait_result(chaos: Chaos, run: str, timeout_s: float = 90) -> RunResult:
    give_up = time.monotonic() + timeout_s
    while (result := chaos.client.result(run)) is None:
        if time.monotonic() > give_up:
            raise AssertionError(f"run {run} never ended\n{stuck_report(chaos, run)}")
        time.sleep(0.1)
    return result


def stuck_report(chaos: Chaos, run: str) -> str:
    """What a run that never ended left: its keys, the watchdog's entries for it, and
    every log line of every worker (restarted ones included) that names it."""
    r = chaos.client.redis
    keys = sorted(k.decode() if isinstance(k, bytes) else k for k in r.scan_iter(f"*{run}*"))
    entries = [e for e in r.zrange(chaos.client.keys.deadlines, 0, -1) if run in str(e)]
    lines = [
        f"{path.name}: {line}"
        for path in sorted(chaos.fleet.logdir.glob("*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if run in line or "Traceback" in line or "Error" in line
    ]
    state = chaos.client.redis.get(chaos.client.keys.state(run))
    return "\n".join(
        [f"keys: {keys}", f"watchdog entries: {entries}", f"state: {state!r}"[:3000], *lines]
    )


def tool_results(result: RunResult) -> dict[str, tuple[str, bool, str]]:
    """tool_use_id -> (the call's marker, is_error, output)."""
    markers: dict[str, str] = {}
    found: dict[str, tuple[str, bool, str]] = {}
    for message in result.messages:
        if isinstance(message.content, str):
            continue
        for block in message.content:
            if block.get("type") == "tool_use":
                markers[block["id"]] = block["input"]["command"].split()[1]
            elif block.get("type") == "tool_result":
                marker = markers[block["tool_use_id"]]
                content = str(block.get("content"))
                found[block["tool_use_id"]] = (marker, bool(block.get("is_error")), content)
    return found


def check_run(chaos: Chaos, run: str, ran: collections.Counter[str]) -> dict[str, Any]:
    result = wait_result(chaos, run)
    time.sleep(0.05)  # the terminal event follows the stored result
    events = [e for _, e in read_events(chaos.client.redis, chaos.client.keys, run, count=10_000)]
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), run
    terminal = [e for e in events if e.type in TERMINAL_EVENTS]
    assert len(terminal) == 1 and terminal[0] is events[-1], (run, [e.type for e in events])
    assert is_valid_history(result.messages) == [], run
    calls = tool_results(result)
    duplicates = [m for m, _, _ in calls.values() if ran[m] > 1]
    for marker, is_error, output in calls.values():
        if not is_error:
            assert ran[marker] == 1, (run, marker, output)
    status = {e.data["tool_call_id"]: e.data["status"] for e in events if e.type == "TOOL_END"}
    return {
        "status": result.status,
        "calls": [status.get(tool_use_id, "none") for tool_use_id in calls],
        "duplicates": duplicates,
    }


@pytest.mark.parametrize(
    "how_many",
    [
        pytest.param(SHORT_RUNS, id="short"),
        pytest.param(RUNS, id="soak", marks=pytest.mark.soak),
    ],
)
def test_every_run_survives_a_sigkill(chaos: Chaos, how_many: int) -> None:
    began = time.monotonic()
    runs: list[str] = []
    for _ in range(how_many // PARALLEL):
        batch = run_batch(chaos, PARALLEL)
        for run in batch:
            wait_result(chaos, run)
        runs += batch
        chaos.fleet.wait_ready(("alpha", "beta"), timeout_s=60)
    time.sleep(1.0)  # let orphaned tool processes of killed machines finish writing
    ran = collections.Counter(chaos.effects.read_text().split())
    checked = {run: check_run(chaos, run, ran) for run in runs}

    statuses = collections.Counter(c["status"] for c in checked.values())
    calls = collections.Counter(s for c in checked.values() for s in c["calls"])
    duplicates = [d for c in checked.values() for d in c["duplicates"]]
    repeated = asked_again(chaos, runs)
    print(
        f"[chaos] {len(runs)} runs in {time.monotonic() - began:.0f} s; "
        f"kills {dict(chaos.kills)} (total {sum(chaos.kills.values())}); "
        f"runs {dict(statuses)}; tool results {dict(calls)}; duplicates {len(duplicates)}; "
        f"model calls repeated {len(repeated)}"
    )
    assert sum(chaos.kills.values()) >= how_many
    assert statuses == {"done": len(runs)}  # no run lost
    assert duplicates == []  # no side effect twice
    assert repeated == []  # no model call repeated


def asked_again(chaos: Chaos, runs: list[str]) -> list[tuple[str, int]]:
    """Each (run, turn) the model was asked for again although no coordinator died
    since it was last asked: a reply asked for twice that no kill cut off."""
    asks: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    for request in chaos.fake.requests():
        messages = request["body"].get("messages") or [{}]
        first = str(messages[0])
        for run in (run for run in runs if f"[[script:s{run}]]" in first):
            turn = 1 + sum(m.get("role") == "assistant" for m in messages)
            asks[(run, turn)].append(request["received_ms"])
    return [
        key
        for key, times in asks.items()
        for before, after in itertools.pairwise(sorted(times))
        if not any(before < death < after for death in chaos.coordinator_deaths)
    ]


def test_a_coordinator_killed_mid_model_call_is_taken_over(chaos: Chaos) -> None:
    """The dead coordinator's turn lease lapses, the watchdog of the restarted one
    enqueues the turn again, and the turn runs — long before the broker's visibility
    timeout would have brought the message back. (The reply takes 1.5 s: under the
    2 s stream idle timeout, so the only second request is the taken-over turn's.)"""
    name = f"slow{uuid.uuid4().hex[:10]}"
    marker = f"[[script:{name}]]"
    chaos.fake.add_script(
        name, [{"content": [{"type": "text", "text": "slow"}], "latency_ms": 1500}]
    )
    run = chaos.client.submit(prompt=f"{marker} go", timeout_s=60)

    def asked() -> int:
        return sum(marker in str(r["body"].get("messages")) for r in chaos.fake.requests())

    give_up = time.monotonic() + 20
    while asked() == 0:
        assert time.monotonic() < give_up
        time.sleep(0.05)
    chaos.restart("coordinator")
    result = wait_result(chaos, run.run_id, timeout_s=60)
    assert result.status == "done" and result.text == "slow"
    assert asked() == 2


def test_a_turn_taken_over_mid_stream_repeats_no_token(chaos: Chaos) -> None:
    """The restarted turn streams the same answer again; clients are sent only the part
    they had not seen."""
    name = f"stream{uuid.uuid4().hex[:10]}"
    text = " ".join(f"w{i}" for i in range(120))
    chaos.fake.add_script(name, {"turns": [[{"type": "text", "text": text}]], "token_delay_ms": 40})
    run = chaos.client.submit(prompt=f"[[script:{name}]] go", timeout_s=60)
    seen = 0
    for event in run.events():
        seen += event.type == "TOKEN"
        if seen == 5:
            break
    chaos.restart("coordinator")
    result = wait_result(chaos, run.run_id, timeout_s=60)
    tokens = [e.data["text"] for e in run.events(idle_timeout_s=10) if e.type == "TOKEN"]
    assert result.status == "done" and result.text == text
    assert "".join(tokens) == text


def both_calls_out_mid_reply(chaos: Chaos, prefix: str, answer: str) -> tuple[str, str, Any]:
    """Start a run whose turn 1 makes a call on each machine, then streams a long text
    (4 s); return once both calls started, the reply still streaming: its id, its
    script's marker and its handle. Turn 2 answers `answer`."""
    run = f"{prefix}{uuid.uuid4().hex[:10]}"
    name = f"s{run}"
    long_text = " ".join(f"w{i}" for i in range(300))
    reply = [*tool_turn(run, 1, chaos.effects), {"type": "text", "text": long_text}]
    turns = [{"content": reply}, [{"type": "text", "text": answer}]]
    chaos.fake.add_script(name, {"turns": turns, "token_delay_ms": 40})
    marker = f"[[script:{name}]]"
    handle = chaos.client.submit(prompt=f"{marker} go", run_id=run, timeout_s=90)
    started = 0
    for event in handle.events(idle_timeout_s=30):
        started += event.type == "TOOL_START"
        if started == 2:
            break
    return run, marker, handle


def test_a_coordinator_killed_after_sending_calls_early_asks_the_model_nothing_again(
    chaos: Chaos,
) -> None:
    """The reply's two calls go out while its long text still streams; the coordinator
    is SIGKILLed then. The turn taken over goes on with the stored reply: the model is
    not asked again for turn 1 and neither call runs twice."""
    run, marker, _ = both_calls_out_mid_reply(chaos, "early", "all done")
    chaos.restart("coordinator")
    result = wait_result(chaos, run)
    time.sleep(1.0)  # an orphaned tool process may still be writing
    ran = collections.Counter(chaos.effects.read_text().split())

    assert result.status == "done" and result.text.endswith("all done")
    assert ran[f"{run}:1:alpha"] == 1 and ran[f"{run}:1:beta"] == 1
    assert is_valid_history(result.messages) == []
    asked = [r for r in chaos.fake.requests() if marker in str(r["body"].get("messages"))]
    assert len(asked) == 2  # turn 1 once (cut by the kill), turn 2 once
    first = next(m for m in result.messages if m.role == "assistant")
    assert [b["type"] for b in first.content] == ["text", "tool_use", "tool_use"]


def test_a_turn_taken_over_after_a_cancel_keeps_the_calls_it_sent(chaos: Chaos) -> None:
    """The coordinator dies after both calls went out early, and an operation cancel
    comes before another takes the turn over: the calls are in the history with their
    results (they ran, once), and the run ends cancelled without asking the model again."""
    run, marker, handle = both_calls_out_mid_reply(chaos, "gone", "never")
    chaos.fleet.workers["coordinator"].kill()
    chaos.kills["coordinator"] += 1
    chaos.coordinator_deaths.append(time.monotonic() * 1000)
    handle.cancel(reason="user")  # before anyone takes the turn over
    chaos.fleet.start_coordinator()
    result = wait_result(chaos, run)
    time.sleep(1.0)
    ran = collections.Counter(chaos.effects.read_text().split())

    assert result.status == "cancelled"
    assert ran[f"{run}:1:alpha"] == 1 and ran[f"{run}:1:beta"] == 1
    assert is_valid_history(result.messages) == []
    outputs = [
        str(b.get("content"))
        for m in result.messages
        if m.role == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    ]
    # Each call answered by what it printed: it ran to its end, not "cancelled".
    assert [sum(f"{run}:1:{m}" in o for o in outputs) for m in ("alpha", "beta")] == [1, 1]
    assert len(outputs) == 2
    asked = [r for r in chaos.fake.requests() if marker in str(r["body"].get("messages"))]
    assert len(asked) == 1


def test_a_start_popped_by_a_coordinator_killed_before_reading_it_is_not_lost(
    chaos: Chaos,
) -> None:
    """kombu's Redis transport takes a message off its queue (BRPOP) before it records
    it as unacknowledged, so a coordinator SIGKILLed in between loses it for good: no
    visibility timeout brings it back. Built here through the real worker: the
    coordinator is stopped (SIGSTOP) with its BRPOP pending, the run's `cmdop.run` is
    sent and popped into its socket, and the coordinator is SIGKILLed and restarted.
    The run must still start and end."""
    coordinator = chaos.fleet.workers["coordinator"]
    for _ in range(10):
        coordinator.signal(signal.SIGSTOP)
        run = submit_one_line(chaos, "started after all")
        if popped(chaos, COORDINATOR_QUEUE):
            break
        coordinator.signal(signal.SIGCONT)  # no BRPOP was pending: it runs; try again
        wait_result(chaos, run)
    else:
        pytest.fail("the stopped coordinator never had a BRPOP pending")
    chaos.restart("coordinator")
    result = wait_result(chaos, run, timeout_s=30)
    assert result.status == "done" and result.text == "started after all"


def test_a_start_is_let_go_once_handled_even_when_refused(chaos: Chaos) -> None:
    """The entry that would send a start again goes once a coordinator handled it: a
    start refused for good (an unknown agent) is not sent again."""
    r, keys = chaos.client.redis, chaos.client.keys
    run = chaos.client.submit(prompt="hi", agent="nobody-by-that-name").run_id
    give_up = time.monotonic() + 20
    while r.exists(keys.start(run)) or r.zscore(keys.deadlines, start_member(run)) is not None:
        assert time.monotonic() < give_up, "the refused start's entry stayed"
        time.sleep(0.05)
    assert r.get(keys.state(run)) is None


def submit_one_line(chaos: Chaos, text: str) -> str:
    name = f"line{uuid.uuid4().hex[:10]}"
    chaos.fake.add_script(name, [{"content": [{"type": "text", "text": text}]}])
    return chaos.client.submit(prompt=f"[[script:{name}]] go", timeout_s=60).run_id


def popped(chaos: Chaos, queue: str, within_s: float = 0.5) -> bool:
    """Whether a worker's pending BRPOP took the queue's messages (the queue is empty)."""
    give_up = time.monotonic() + within_s
    while chaos.client.redis.llen(queue):
        if time.monotonic() > give_up:
            return False
        time.sleep(0.01)
    return True
