"""Threads through the real fleet: follow-ups from stored history, the prompt cache kept
across runs, each `on_busy` policy with two clients racing, and steering a busy run.
A thread with nothing running, and a bad thread id, need no worker (`turn_harness`)."""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from cmdop_worker.core.request import cache_prefix, request_bytes
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client, Run
from tests.e2e.test_cli import text
from tests.e2e.test_cli import tool as cli_tool

pytestmark = pytest.mark.integration


def tool(command: str) -> dict[str, Any]:
    return cli_tool("alpha", command)


@pytest.fixture
def thread_id() -> str:
    return f"th-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def second_client(client: Client) -> Iterator[Client]:
    with Client(client.settings) as other:
        yield other


def wait_for(run: Run[Any], kind: str) -> Event:
    for event in run.events(idle_timeout_s=30):
        if event.type == kind:
            return event
    raise AssertionError(f"run {run.run_id} ended without a {kind} event")


def last_user_text(body: dict[str, Any]) -> str:
    content = body["messages"][-1]["content"]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return " ".join(b.get("text", "") for b in blocks if b.get("type") == "text")


def racing(*submits: Any) -> list[Any]:
    """Call every `submit` at once from its own thread; their results (or errors)."""
    results: list[Any] = [None] * len(submits)
    gate = threading.Barrier(len(submits))

    def go(index: int) -> None:
        gate.wait()
        try:
            results[index] = submits[index]()
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(submits))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_a_five_run_thread_continues_its_history_and_keeps_the_prompt_cache(
    client, script, thread_id, capsys
) -> None:
    prompt = script(
        [
            [*text("looking"), tool("echo first-run")],
            text("answer one"),
            text("answer two"),
            [tool("echo fourth-run")],
            text("answer four"),
            text("answer five"),
            text("answer six"),
        ]
    )
    follow_ups = ["and on db-1?", "and the load?", "and the disk?", "thanks, all?"]
    runs: list[Run[Any]] = []
    for text_sent in [prompt, *follow_ups]:
        run = client.submit(prompt=text_sent, thread_id=thread_id, timeout_s=60)
        ended = run.wait(timeout=60)
        runs.append(run)
        # Whoever sees a run end finds the thread free and holding its history: a
        # follow-up sent at once continues from all of it.
        info = client.thread(thread_id)
        assert info is not None and info.active is None
        assert client.thread_store.history(thread_id) == ended.messages

    results = [run.wait(timeout=5) for run in runs]
    assert [r.text for r in results] == [
        "answer one",
        "answer two",
        "answer four",
        "answer five",
        "answer six",
    ]
    assert all(r.status == "done" for r in results)
    info = client.thread(thread_id)
    assert info is not None and info.runs == [run.run_id for run in runs] and info.active is None

    # Each run's history is the previous run's, then its own prompt.
    for before, after in itertools.pairwise(results):
        assert after.messages[: len(before.messages)] == before.messages

    # The cache prefix: each run's first request starts with the bytes of the previous
    # run's last request up to its last breakpoint, and the model reads them cached.
    requests = script.requests_for(prompt)
    firsts = [
        i
        for i, rec in enumerate(requests)
        if any(follow_up in last_user_text(rec["body"]) for follow_up in follow_ups)
    ]
    assert len(firsts) == 4
    shares = []
    for index in firsts:
        previous, first = requests[index - 1]["body"], requests[index]["body"]
        assert request_bytes(first).startswith(cache_prefix(previous))
        usage = requests[index]["response"]["usage"]
        total = sum(
            usage[k]
            for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        )
        shares.append(usage["cache_read_input_tokens"] / total)
    with capsys.disabled():
        print(f"\ncache-read share of input tokens, runs 2-5: {[f'{s:.2f}' for s in shares]}")
    assert all(share > 0.5 for share in shares), shares


def test_reject_refuses_both_racing_requests_and_starts_nothing(
    client, second_client, script, thread_id
) -> None:
    busy = client.submit(prompt=script([[tool("sleep 3")], text("slept")]), thread_id=thread_id)
    wait_for(busy, "TOOL_START")
    racers = racing(
        lambda: client.submit(prompt="me first", thread_id=thread_id),
        lambda: second_client.submit(prompt="no, me", thread_id=thread_id),
    )
    for racer in racers:
        # `ThreadBusy` is an `InvalidRequest`; the refusal and its message are the claim.
        with pytest.raises(InvalidRequest, match=f"busy with run {busy.run_id}"):
            racer.wait(timeout=20)
        assert client.store.load(racer.run_id) is None
    assert busy.wait(timeout=30).status == "done"
    info = client.thread(thread_id)
    assert info is not None and info.runs == [busy.run_id]


def test_enqueue_runs_racing_requests_one_after_another_in_thread_order(
    client, second_client, script, thread_id
) -> None:
    first = client.submit(
        prompt=script([[tool("sleep 2")], text("one"), text("two"), text("three")]),
        thread_id=thread_id,
    )
    wait_for(first, "TOOL_START")
    queued = racing(
        lambda: client.submit(prompt="second", thread_id=thread_id, on_busy="enqueue"),
        lambda: second_client.submit(prompt="third", thread_id=thread_id, on_busy="enqueue"),
    )
    results = [run.wait(timeout=60) for run in [first, *queued]]
    assert all(r.status == "done" for r in results)
    info = client.thread(thread_id)
    assert info is not None and info.runs[0] == first.run_id
    assert sorted(info.runs[1:]) == sorted(run.run_id for run in queued)
    # In the thread's order, each run started after the one before it ended, from its
    # history: one at a time, nothing lost.
    by_id = {r.run_id: r for r in results}
    ordered = [by_id[run_id] for run_id in info.runs]
    for before, after in itertools.pairwise(ordered):
        assert after.messages[: len(before.messages)] == before.messages
        assert (client.run(after.run_id).started_ms() or 0) >= _ended_ms(client, before.run_id)
    assert [r.text for r in ordered] == ["one", "two", "three"]


def _ended_ms(client: Client, run_id: str) -> int:
    return next(e.ts_ms for e in client.events_so_far(run_id) if e.is_terminal)


def test_interrupt_cancels_the_running_run_and_continues_from_its_valid_history(
    client, script, thread_id
) -> None:
    running = client.submit(
        prompt=script([[tool("sleep 60")], text("after the interruption")]),
        thread_id=thread_id,
        timeout_s=120,
    )
    wait_for(running, "TOOL_START")
    interrupting = client.submit(
        prompt="stop that, do this", thread_id=thread_id, on_busy="interrupt"
    )
    cancelled = running.wait(timeout=20, raise_on_failure=False)
    assert cancelled.status == "cancelled" and cancelled.cancel is not None
    assert cancelled.cancel.channel == "ui"
    assert cancelled.cancel.reason == f"interrupted by run {interrupting.run_id}"
    done = interrupting.wait(timeout=30)
    assert done.text == "after the interruption"
    # The sleep's call is answered in the history the new run started from.
    use = next(
        b
        for m in done.messages
        if m.role == "assistant" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_use"
    )
    answers = [
        b
        for m in done.messages
        if m.role == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result" and b["tool_use_id"] == use["id"]
    ]
    assert len(answers) == 1 and answers[0].get("is_error") is True


def test_steering_during_a_long_tool_reaches_the_very_next_request(
    client, second_client, script, thread_id
) -> None:
    prompt = script([[tool("sleep 2")], text("heard: {{last_user_text}}")])
    running = client.submit(prompt=prompt, thread_id=thread_id)
    wait_for(running, "TOOL_START")
    steering = second_client.submit(prompt="also check db-1", thread_id=thread_id, on_busy="steer")
    result = running.wait(timeout=30)
    steered = steering.wait(timeout=5)
    assert steering.run_id == running.run_id and steering.steered_from is not None
    assert steered.run_id == running.run_id
    assert "also check db-1" in result.text
    assert [
        e.data["text"] for e in client.events_so_far(running.run_id) if e.type == "STEERED"
    ] == ["also check db-1"]
    # The next request carried the tool's result and the message after it.
    second = script.requests_for(prompt)[1]["body"]["messages"][-1]["content"]
    kinds = [b["type"] for b in second]
    assert kinds[0] == "tool_result" and "also check db-1" in last_user_text(
        script.requests_for(prompt)[1]["body"]
    )
    assert client.thread(thread_id).runs == [running.run_id]


def test_steering_during_a_streamed_reply_keeps_the_run_going(client, script, thread_id) -> None:
    prompt = script(
        [
            {"content": text("a slow answer"), "latency_ms": 1500},
            text("and now: {{last_user_text}}"),
        ]
    )
    running = client.submit(prompt=prompt, thread_id=thread_id, stream=True)
    # Steer while the first model call is still in flight.
    _wait_requests(script, prompt, 1)
    client.submit(prompt="and the logs?", thread_id=thread_id, on_busy="steer")
    result = running.wait(timeout=30)
    assert result.turns == 2
    assert result.text.startswith("and now: and the logs?")
    assert any(e.type == "STEERED" for e in client.events_so_far(running.run_id))


def _wait_requests(script: Any, prompt: str, count: int) -> None:
    import time

    give_up = time.monotonic() + 20
    while len(script.requests_for(prompt)) < count:
        assert time.monotonic() < give_up, "the model was never called"
        time.sleep(0.02)


def test_steer_on_an_idle_thread_is_a_normal_run(turn_harness, script, thread_id) -> None:
    client = turn_harness.client
    run = client.submit(prompt=script([text("fresh")]), thread_id=thread_id, on_busy="steer")
    result = run.wait(timeout=30)
    assert result.text == "fresh" and run.steered_from is None


def test_a_bad_thread_id_is_refused_before_anything_is_sent(turn_harness) -> None:
    client = turn_harness.client
    with pytest.raises(InvalidRequest, match="thread_id"):
        client.submit(prompt="hi", thread_id="not a thread id!")


def test_a_message_too_late_for_the_last_turn_is_answered_by_a_follow_up_run(
    client, script, thread_id
) -> None:
    prompt = script(
        [
            {"content": text("the only turn"), "latency_ms": 1500},
            text("following up on: {{last_user_text}}"),
        ]
    )
    running = client.submit(prompt=prompt, thread_id=thread_id, max_turns=1)
    _wait_requests(script, prompt, 1)
    client.submit(prompt="one more thing", thread_id=thread_id, on_busy="steer")
    first = running.wait(timeout=30)
    assert first.stop_reason == "end_turn" and first.text == "the only turn"
    late = client.run(f"{running.run_id}-late").wait(timeout=30)
    assert late.text.startswith("following up on: one more thing")
    assert client.thread(thread_id).runs == [running.run_id, late.run_id]


def test_a_waiting_request_that_can_no_longer_start_does_not_hold_the_thread(
    client, script, thread_id
) -> None:
    running = client.submit(prompt=script([[tool("sleep 2")], text("one")]), thread_id=thread_id)
    wait_for(running, "TOOL_START")
    # A request that waited while its agent was taken out of the configuration.
    stale = {"run_id": uuid.uuid4().hex, "prompt": "x", "agent": "retired", "thread_id": thread_id}
    client.redis.rpush(client.keys.thread(thread_id, "queue"), json.dumps(stale))
    after = client.submit(prompt="and then?", thread_id=thread_id, on_busy="enqueue")
    assert running.wait(timeout=30).status == "done"
    assert after.wait(timeout=30).status == "done"
    assert client.thread(thread_id).queued == 0
