"""The Python client as a service would use it: typed errors, structured output, asyncio."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from pydantic import BaseModel

from cmdop_worker.config import Settings
from cmdop_worker.errors import DuplicateRun, InvalidRequest, RunCancelled, WaitTimeout
from cmdop_worker.models import RunRequest
from cmdop_worker.surfaces.aio import AsyncClient
from cmdop_worker.surfaces.client import Client, output_schema_of, request_repr
from cmdop_worker.surfaces.typed_events import DoneEvent, ToolEndEvent, typed_event

pytestmark = pytest.mark.e2e


class Disk(BaseModel):
    free_gb: int
    mount: str


class Report(BaseModel):
    machine: str
    healthy: bool
    disks: list[Disk]


REPORT_JSON = '{"machine": "alpha", "healthy": true, "disks": [{"free_gb": 12, "mount": "/"}]}'


def test_a_run_the_fleet_refuses_raises_invalid_request_instead_of_hanging(client) -> None:
    # The client cannot know the fleet's agents: only the coordinator can refuse this.
    run = client.submit(prompt="hi", agent="no-such-agent")
    # A wait that hung on the refused run would raise WaitTimeout instead.
    with pytest.raises(InvalidRequest, match="unknown agent 'no-such-agent'"):
        run.wait(timeout=20)
    with pytest.raises(InvalidRequest, match="agent"):
        list(run.events())


def test_structured_output_comes_back_as_a_model_instance(client, script) -> None:
    prompt = script([[{"type": "text", "text": f"Here it is:\n```json\n{REPORT_JSON}\n```"}]])
    run = client.submit(prompt=prompt, output_type=Report)
    report = run.output(timeout=30)
    assert isinstance(report, Report)
    assert report == Report(machine="alpha", healthy=True, disks=[Disk(free_gb=12, mount="/")])
    assert run.wait(timeout=1).output == report.model_dump()


def test_the_output_schema_sent_has_no_refs_left() -> None:
    schema = output_schema_of(Report)
    assert "$ref" not in str(schema) and "$defs" not in schema
    assert schema["properties"]["disks"]["items"]["required"] == ["free_gb", "mount"]


def test_events_are_typed_per_event_type(client, script) -> None:
    prompt = script(
        [
            [
                {
                    "type": "tool_use",
                    "name": "execute_command",
                    "input": {"machine": "beta", "command": "echo hi"},
                }
            ],
            [{"type": "text", "text": "ok"}],
        ]
    )
    events = [typed_event(e) for e in client.submit(prompt=prompt).events(idle_timeout_s=30)]
    end = next(e for e in events if isinstance(e, ToolEndEvent))
    assert end.data.machine == "beta" and end.data.output.strip().endswith("hi")
    assert isinstance(events[-1], DoneEvent) and events[-1].data.turns == 2


def test_a_taken_run_id_is_refused_before_sending(client, script) -> None:
    run_id = f"taken-{uuid.uuid4().hex[:8]}"
    client.submit(prompt=script([[{"type": "text", "text": "one"}]]), run_id=run_id).wait(
        timeout=20
    )
    with pytest.raises(DuplicateRun, match=run_id):
        client.submit(prompt="again", run_id=run_id)


def test_exists_answers_whether_the_fleet_holds_the_run(client, script) -> None:
    assert client.run(f"never-{uuid.uuid4().hex[:8]}").exists() is False
    run = client.submit(prompt=script([[{"type": "text", "text": "here"}]]))
    run.wait(timeout=20)
    assert run.exists() is True


def test_wait_times_out_then_a_ui_cancel_ends_the_run(client, script) -> None:
    sleep = {"machine": "alpha", "command": "sleep 30"}
    run = client.submit(
        prompt=script([[{"type": "tool_use", "name": "execute_command", "input": sleep}]])
    )
    with pytest.raises(WaitTimeout):
        run.wait(timeout=1)
    assert run.cancel(ui=True, reason="test")
    with pytest.raises(RunCancelled) as caught:
        run.wait(timeout=10)
    assert caught.value.result.cancel is not None
    assert caught.value.result.cancel.channel == "ui"


def test_asyncio_client_submits_follows_and_waits(settings, fleet, script) -> None:
    prompt = script([[{"type": "text", "text": "async hello"}]])

    async def scenario() -> tuple[list[str], str]:
        aclient = AsyncClient(Client(settings))
        try:
            run = await aclient.submit(prompt=prompt)
            types = [event.type async for event in run.events(idle_timeout_s=30)]
            result = await run.wait(timeout=10)
            return types, result.text
        finally:
            aclient.sync.close()

    types, text = asyncio.run(scenario())
    assert types[-1] == "DONE" and "TOKEN" in types
    assert text == "async hello"


def test_flower_sees_a_short_request_not_the_payload() -> None:
    request = RunRequest(run_id="r1", prompt="x" * 5000, machine="alpha")
    shown = request_repr(request)
    assert "'run_id': 'r1'" in shown and "'machine': 'alpha'" in shown
    assert "'agent': 'operator'" in shown
    assert len(shown) < 200


def test_wait_blocks_until_the_end_without_waking_at_every_event(client) -> None:
    """A waiter costs Redis nothing per event: it wakes when the terminal event lands."""
    from cmdop_worker.models import RunResult
    from cmdop_worker.runtime import now_ms
    from cmdop_worker.state.events import EventSink

    run = client.run(f"wait-{uuid.uuid4().hex[:8]}")
    sink = EventSink(client.redis, client.keys, maxlen=1000, ttl_s=60, clock_ms=now_ms)

    emitting = {"evalsha", "exists", "incr", "xadd", "publish"}  # what `emit` runs

    def commands_besides_emits() -> int:
        stats = client.redis.info("commandstats")
        return sum(v["calls"] for k, v in stats.items() if k[8:] not in emitting)

    waited: list[RunResult] = []
    waiter = threading.Thread(target=lambda: waited.append(run.wait(timeout=30)), daemon=True)
    waiter.start()
    time.sleep(0.1)
    before = commands_besides_emits()
    for i in range(200):
        sink.emit(run.run_id, "TOKEN", 1, {"text": f"w{i} "})
        time.sleep(0.002)
    issued = commands_besides_emits() - before
    assert waiter.is_alive() and not waited
    # The fleet's own background work (heartbeats, watchdogs) is a few dozen commands
    # in this time; a waiter that woke at every event would add several per event.
    assert issued < 150, f"{issued} commands while 200 events were emitted"
    result = RunResult(run_id=run.run_id, status="done", stop_reason="end_turn", text="finished")
    client.store.store_result(result)
    sink.emit(run.run_id, "DONE", 1, {"text": "finished"})
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    assert waited[0].text == "finished"


def test_a_read_only_client_still_waits_for_the_end(client, settings, script) -> None:
    """BLMOVE is a write: a read-only user (or replica) waits on the event stream."""
    password = uuid.uuid4().hex
    client.redis.execute_command(
        "ACL",
        "SETUSER",
        "cmdop-reader",
        "on",
        f">{password}",
        "~*",
        "&*",
        "+@read",
        "+@connection",
        "+@pubsub",
    )
    try:
        run = client.submit(prompt=script([[{"type": "text", "text": "read-only wait"}]]))
        host = settings.redis_url.split("://", 1)[1]
        reader = Settings(redis_url=f"redis://cmdop-reader:{password}@{host}")

        def refused_blmoves() -> int:
            stats = client.redis.info("commandstats").get("cmdstat_blmove", {})
            return int(stats.get("rejected_calls", 0)) + int(stats.get("failed_calls", 0))

        before = refused_blmoves()
        with Client(reader) as readonly:
            assert readonly.run(run.run_id).wait(timeout=30).text == "read-only wait"
        assert refused_blmoves() - before < 20  # it blocked on events, it did not spin
    finally:
        client.redis.execute_command("ACL", "DELUSER", "cmdop-reader")
