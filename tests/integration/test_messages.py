"""The messages the fleet sends, as they reach the broker, whoever sends them.

On the session fleet's Redis, with the fleet's own Celery app: the message recovery
sends for a coordinator tool of a cut-short turn is the message a sequential turn sends
(`messages.local_tool_message`): same queue, its deadline, its headers.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.signals import before_task_publish

from cmdop_worker import messages
from cmdop_worker.celery_app import create_app
from cmdop_worker.coordinator.recovery import redispatch
from cmdop_worker.coordinator.runs import initial_state
from cmdop_worker.core.intake import parse_request
from cmdop_worker.messages import local_tool_message
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.keys import CONTINUATION_QUEUE
from cmdop_worker.state.store import PendingCall

pytestmark = pytest.mark.integration


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch, settings) -> Iterator[list[dict[str, Any]]]:
    """Every message this process publishes, as Celery hands it to kombu, sent on the
    session fleet's broker."""
    monkeypatch.setattr(messages, "app", create_app(settings))
    seen: list[dict[str, Any]] = []

    def note(body: Any, routing_key: str, headers: dict[str, Any], **_: Any) -> None:
        args = body[0]  # (args, kwargs, embed): protocol 2
        seen.append({"queue": routing_key, "headers": headers, "args": list(args)})

    before_task_publish.connect(note, weak=False)
    yield seen
    before_task_publish.disconnect(note)


def test_recovery_resends_a_coordinator_tool_as_a_turn_sends_it(
    rt: Runtime, published: list[dict[str, Any]]
) -> None:
    run_id = f"resend-{uuid.uuid4().hex[:10]}"
    deadline_ms = now_ms() + 60_000
    call = PendingCall(
        tool_use_id="toolu_list_1", tool="list_machines", machine=None, deadline_ms=deadline_ms
    )
    # A parallel turn whose executor died before running its coordinator tool. The run
    # is not stored, so the coordinator that takes the message runs nothing.
    state = initial_state(rt, parse_request({"prompt": "x"}), run_id)
    state = state.model_copy(update={"turn": 1, "awaiting": [call]})
    redispatch(rt, state, 1)

    (sent,) = [m for m in published if m["headers"].get("id") == f"{run_id}.toolu_list_1"]
    expected = local_tool_message(run_id, 1, "toolu_list_1", deadline_ms=deadline_ms, headers={})
    assert sent["headers"]["task"] == expected.task == "cmdop.local_tool"
    assert sent["queue"] == expected.queue == CONTINUATION_QUEUE
    assert sent["args"] == list(expected.args) == [run_id, 1, "toolu_list_1", deadline_ms]
