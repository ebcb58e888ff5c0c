"""The model fault matrix, through the whole fleet and the real SDK.

Each fault of the fake server either recovers within the retry policy (the run ends
DONE, one RETRY event per failed attempt with its attempt number, delay and cause, and
the fake saw exactly as many requests as attempts) or, repeated as often as there are
attempts (`CMDOP_LLM_ATTEMPTS`, 6), ends the run with one ERROR naming the cause.
Client errors (400, 401) are never retried. The coordinator alone decides all of this:
the runs are taken in this process (`tests.harness`), whose settings compress backoff as
the session fleet's do.
"""

from __future__ import annotations

from typing import Any

import pytest

from cmdop_worker.models import TERMINAL_EVENTS, Event
from cmdop_worker.surfaces.client import Client
from tests.harness import TurnHarness

pytestmark = pytest.mark.integration


@pytest.fixture
def client(turn_harness: TurnHarness) -> Client:
    """A client of the in-process coordinator: no worker."""
    return turn_harness.client


ATTEMPTS = 6
TEXT = "the quick brown fox jumps over the lazy dog, twice over and then some more"

# name -> (fault, the cause's name in RETRY and ERROR)
FAULTS: dict[str, tuple[dict[str, Any], str]] = {
    "429": ({"kind": "status", "status": 429, "retry_after_s": 0.1}, "http_429"),
    "529": ({"kind": "status", "status": 529}, "http_529"),
    "500": ({"kind": "status", "status": 500}, "http_500"),
    "reset": ({"kind": "reset"}, "connection"),
    "error_event": ({"kind": "error_event", "after_events": 4}, "stream_error"),
    "truncate": ({"kind": "truncate", "after_events": 4}, "stream_truncated"),
    "malformed": ({"kind": "malformed"}, "malformed"),
}


def run_with_fault(client, script, fault: dict[str, Any]) -> tuple[list[Event], Any, list[Any]]:
    """The run's events, its result and the requests the fake saw for it."""
    prompt = script([{"content": [{"type": "text", "text": TEXT}], "fault": fault}])
    run = client.submit(prompt=prompt, timeout_s=60)
    events = list(run.events(idle_timeout_s=30))
    result = run.wait(timeout=10, raise_on_failure=False)
    return events, result, script.requests_for(prompt)


def retries_of(events: list[Event]) -> list[dict[str, Any]]:
    """The RETRY events of failed attempts (a wait for the fleet's rate limiter is none)."""
    found = [e.data for e in events if e.type == "RETRY"]
    return [r for r in found if not str(r["cause"]).startswith("rate_limit_wait")]


def assert_one_terminal(events: list[Event]) -> Event:
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    terminal = [e for e in events if e.type in TERMINAL_EVENTS]
    assert len(terminal) == 1 and terminal[0] is events[-1]
    return terminal[0]


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_passing_fault_is_retried_and_the_run_recovers(client, script, name) -> None:
    fault, cause = FAULTS[name]
    events, result, requests = run_with_fault(client, script, {**fault, "times": 2})

    assert assert_one_terminal(events).type == "DONE"
    assert result.status == "done" and result.text == TEXT
    retries = retries_of(events)
    assert [r["attempt"] for r in retries] == [1, 2]
    assert all(r["delay_ms"] >= 0 and r["cause"].startswith(cause) for r in retries), retries
    if name == "429":  # the server's retry-after (100 ms) wins over the compressed backoff
        assert all(r["delay_ms"] >= 100 for r in retries), retries
    assert len(requests) == 3
    # No token reached a reader twice, whatever the failed attempts streamed.
    assert "".join(e.data["text"] for e in events if e.type == "TOKEN") == TEXT


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_fault_outlasting_the_attempts_ends_the_run_with_one_error(client, script, name) -> None:
    fault, cause = FAULTS[name]
    events, result, requests = run_with_fault(client, script, {**fault, "times": ATTEMPTS})

    error = assert_one_terminal(events)
    assert error.type == "ERROR"
    assert error.data["kind"] == f"model_{cause}", error.data
    assert f"after {ATTEMPTS} attempts" in error.data["message"]
    assert result.status == "error" and result.error.kind == f"model_{cause}"
    assert [r["attempt"] for r in retries_of(events)] == list(range(1, ATTEMPTS))
    assert len(requests) == ATTEMPTS


@pytest.mark.parametrize("status", [400, 401])
def test_client_errors_are_never_retried(client, script, status) -> None:
    events, result, requests = run_with_fault(
        client, script, {"kind": "status", "status": status, "times": ATTEMPTS}
    )
    error = assert_one_terminal(events)
    assert error.type == "ERROR" and error.data["kind"] == f"model_http_{status}"
    assert "after 1 attempts" in error.data["message"]
    assert not retries_of(events)
    assert len(requests) == 1
    assert result.status == "error"


def test_a_stalled_stream_falls_back_to_a_plain_call_without_repeating_tokens(
    client, script
) -> None:
    # The stream stalls 3 s after a few words; the idle timeout is 2 s.
    fault = {"kind": "stall", "seconds": 3, "after_events": 5}
    events, result, requests = run_with_fault(client, script, fault)

    assert assert_one_terminal(events).type == "DONE"
    assert result.text == TEXT
    tokens = [e.data["text"] for e in events if e.type == "TOKEN"]
    assert len(tokens) >= 2  # some words streamed before the stall, the rest after
    assert "".join(tokens) == TEXT
    retries = retries_of(events)
    assert len(retries) == 1 and retries[0]["cause"].startswith("timeout"), retries
    assert [r["body"].get("stream") is True for r in requests] == [True, False]
