"""A sequential turn's calls keep their own timeout; the deadline is set on sending."""

from __future__ import annotations

import pytest

from cmdop_worker.core.routing import (
    Refused,
    RoutingRules,
    ToCoordinator,
    ToMachine,
    own_timeout_ms,
    sequential_deadlines,
)
from cmdop_worker.models import ToolCall
from cmdop_worker.state.barrier import QueuedCall

NOW = 1_000_000
GRACE = 5_000
RULES = RoutingRules(
    visible=frozenset(),
    known=frozenset(),
    coordinator_tools=frozenset(),
    target_machine=None,
    default_timeout_ms=120_000,
    grace_ms=GRACE,
    run_deadline_ms=NOW + 300_000,
)


def queued(timeout_ms: int, run_deadline_ms: int) -> QueuedCall:
    call = ToolCall(
        run_id="r",
        turn=1,
        tool_use_id="t2",
        tool="execute_command",
        machine="alpha",
        input={"machine": "alpha", "command": "true"},
        deadline_ms=NOW + 1,
        run_deadline_ms=run_deadline_ms,
    )
    return QueuedCall(
        tool_use_id="t2",
        tool="execute_command",
        send="machine",
        call=call,
        deadline_ms=NOW + 1 + GRACE,
        timeout_ms=timeout_ms,
        run_deadline_ms=run_deadline_ms,
        grace_ms=GRACE,
    )


@pytest.mark.parametrize(
    ("route", "own"),
    [
        (ToMachine("t", "execute_command", "alpha", {}, NOW + 30_000 + GRACE), 30_000),
        (ToCoordinator("t", "list_machines", {}, NOW + 1_000 + GRACE), 1_000),
        (Refused("t", "nope", "invalid", "no such tool"), 0),
    ],
)
def test_a_routed_calls_own_time_is_its_deadline_less_grace(route, own) -> None:
    assert own_timeout_ms(route, RULES, NOW) == own


def test_the_planned_deadlines_still_add_up_the_calls_own_times() -> None:
    routes = [
        ToMachine("a", "execute_command", "alpha", {}, NOW + 10_000 + GRACE),
        Refused("b", "nope", "invalid", "no such tool"),
        ToMachine("c", "execute_command", "alpha", {}, NOW + 20_000 + GRACE),
    ]
    shifted = sequential_deadlines(routes, RULES, NOW)
    assert [getattr(r, "deadline_ms", None) for r in shifted] == [
        NOW + 10_000 + GRACE,
        None,
        NOW + 30_000 + GRACE,
    ]


@pytest.mark.parametrize(
    ("sent_at", "run_deadline", "ends"),
    [
        (NOW + 1_200_000, NOW + 3_600_000, NOW + 1_200_000 + 120_000),  # after a long wait
        (NOW + 3_550_000, NOW + 3_600_000, NOW + 3_600_000),  # the run's deadline first
    ],
)
def test_a_queued_calls_deadline_counts_from_its_sending(sent_at, run_deadline, ends) -> None:
    sent = queued(120_000, run_deadline).handed_out(sent_at)
    assert sent.call is not None and sent.call.deadline_ms == ends
    assert sent.deadline_ms == ends + GRACE


def test_a_queued_call_without_a_time_of_its_own_keeps_what_it_was_stored_with() -> None:
    stored = queued(0, NOW + 3_600_000)
    assert stored.handed_out(NOW + 1_200_000) == stored
