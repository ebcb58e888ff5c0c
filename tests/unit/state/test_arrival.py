"""The continuation queue admits continuations only, whatever the message says."""

from __future__ import annotations

import pytest

from cmdop_worker.state.arrival import CONTINUATIONS, admits, arrived_on
from cmdop_worker.state.keys import CONTINUATION_QUEUE, COORDINATOR_QUEUE, machine_queue

PLAIN = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
RUN = {"task": "cmdop.run", "kwargs": {"request": {"prompt": "x"}}, "immutable": True}


@pytest.mark.parametrize("task", sorted(CONTINUATIONS))
def test_continuations_run_from_either_coordinator_queue(task: str) -> None:
    assert admits(CONTINUATION_QUEUE, task, PLAIN)
    assert admits(COORDINATOR_QUEUE, task, PLAIN)


@pytest.mark.parametrize("follow_up", ["callbacks", "errbacks", "chain", "chord"])
def test_a_continuation_that_would_run_something_after_it_is_refused(follow_up: str) -> None:
    """A `cmdop.turn` for no run at all would still have Celery send its callbacks."""
    task = "cmdop.turn"
    carried = [RUN] if follow_up != "chord" else {"task": "celery.chord_unlock", "args": []}
    assert not admits(CONTINUATION_QUEUE, task, PLAIN | {follow_up: carried})


@pytest.mark.parametrize("embed", [None, [], "x", {"callbacks": [RUN]}])
def test_a_continuation_without_a_plain_embed_is_refused(embed: object) -> None:
    assert not admits(CONTINUATION_QUEUE, "cmdop.turn", embed)


@pytest.mark.parametrize(
    "task", ["cmdop.run", "cmdop.tool", "celery.map", "celery.chain", "", None, ["cmdop.turn"]]
)
def test_anything_else_on_the_continuation_queue_is_refused(task: object) -> None:
    assert not admits(CONTINUATION_QUEUE, task, PLAIN)


def test_other_queues_are_not_gated_here() -> None:
    assert admits(COORDINATOR_QUEUE, "cmdop.run")
    assert admits(machine_queue("web"), "cmdop.tool")
    assert admits(None, "cmdop.run")  # a result or remote-control consumer


class Delivered:
    def __init__(self, **info: object) -> None:
        self.delivery_info = info


def test_the_queue_is_the_consumer_tags_when_the_broker_names_one() -> None:
    tags = {COORDINATOR_QUEUE: "tag-1", CONTINUATION_QUEUE: "tag-2"}
    lying = Delivered(consumer_tag="tag-2", routing_key=COORDINATOR_QUEUE)
    assert arrived_on(lying, tags) == CONTINUATION_QUEUE


def test_else_the_queue_is_the_routing_key() -> None:
    assert arrived_on(Delivered(routing_key=CONTINUATION_QUEUE), {}) == CONTINUATION_QUEUE
    assert arrived_on(Delivered(consumer_tag="x", routing_key="q"), {"other": "y"}) == "q"
    assert arrived_on(object(), {}) is None
