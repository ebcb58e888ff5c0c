"""The in-process turn harness (`tests.harness`) is the fleet's coordinator, minus the
worker: every step of a run is a message on its broker, taken in order, and nothing of
it reaches the session fleet."""

from __future__ import annotations

import uuid

import pytest

from cmdop_worker.errors import InvalidRequest
from cmdop_worker.state.keys import COORDINATOR_QUEUE, Keys
from tests.harness import TurnHarness

pytestmark = pytest.mark.integration

LIST = {"type": "tool_use", "name": "list_machines", "input": {}}


def test_each_step_of_a_run_is_a_message_the_harness_takes(
    turn_harness: TurnHarness, script
) -> None:
    prompt = script([[LIST], [{"type": "text", "text": "none online"}]])
    run = turn_harness.client.submit(prompt=prompt)
    result = run.wait(timeout=30)
    assert (result.status, result.turns, result.text) == ("done", 2, "none online")
    mine = [(t.task, t.task_id) for t in turn_harness.taken if t.task_id.startswith(run.run_id)]
    assert mine == [
        ("cmdop.run", f"{run.run_id}.start"),
        ("cmdop.turn", f"{run.run_id}.turn.1"),
        ("cmdop.turn", f"{run.run_id}.turn.2"),
    ]
    # Nothing is left queued, and the run is under the harness's prefix only.
    assert turn_harness.drain() == 0
    assert turn_harness.client.redis.exists(turn_harness.client.keys.state(run.run_id))
    assert not turn_harness.client.redis.exists(Keys("cmdop:").state(run.run_id))


def test_a_refused_start_is_stored_as_the_worker_stores_it(turn_harness: TurnHarness) -> None:
    run_id = f"refused-{uuid.uuid4().hex[:10]}"
    turn_harness.app.send_task(
        "cmdop.run",
        kwargs={"request": {"prompt": 42, "run_id": run_id}},
        queue=COORDINATOR_QUEUE,
        task_id=f"{run_id}.start",
    )
    assert turn_harness.drain() == 1
    with pytest.raises(InvalidRequest, match="prompt"):
        turn_harness.client.run(run_id).raise_if_refused()
