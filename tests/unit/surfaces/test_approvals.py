"""Who an approval is given `by` is one line of plain text: refused otherwise where it
comes in (the gateway's body, `Client.approve`, the CLI's --by), and kept to one line
where it is shown (`surfaces/approvals.py`, `core/textsafe.py`)."""

from __future__ import annotations

import io

import pytest
from pydantic import ValidationError
from rich.console import Console

from cmdop_worker.core.textsafe import one_line
from cmdop_worker.models import Event
from cmdop_worker.surfaces.approvals import by_problem
from cmdop_worker.surfaces.gateway_schema import ApprovalBody
from cmdop_worker.surfaces.render import LiveView

FINE = [
    "alice",
    "Bob Smith",
    "ci@example.org",
    "ops-team (pager)",
    "José Ñúñez",
    "李雷",
    "👩‍💻 dev",
]
REFUSED = [
    ("bob\n[approved by bob]", "␊"),  # a line of its own for "(via alice)"
    ("bob\r[approved]", "␍"),
    ("bob\r\n", "␍"),
    ("a\tb", "␉"),
    ("nul\x00", "␀"),
    ("bob\x1b[8m", "␛"),
    ("del\x7f", "␡"),
    ("nel\x85", "<U+0085>"),  # C1 next line
    ("csi\x9b2J", "<U+009B>"),
    ("ls\u2028x", "<U+2028>"),  # line separator
    ("ps\u2029x", "<U+2029>"),
    ("rlo\u202ecilA", "<U+202E>"),  # bidi override
    ("iso\u2066x\u2069", "<U+2066>"),
    ("mark\u200ex", "<U+200E>"),
    ("alm\u061cx", "<U+061C>"),
]


@pytest.mark.parametrize("by", FINE)
def test_a_name_on_one_line_is_taken(by: str) -> None:
    assert by_problem(by) is None
    assert ApprovalBody(by=by).by == by


@pytest.mark.parametrize(("by", "shown"), REFUSED)
def test_a_control_line_break_or_bidi_character_in_by_is_refused(by: str, shown: str) -> None:
    problem = by_problem(by)
    assert problem is not None and f"({shown})" in problem
    with pytest.raises(ValidationError) as refused:
        ApprovalBody(by=by)
    assert refused.value.errors()[0]["loc"] == ("by",)


@pytest.mark.parametrize(("by", "_shown"), REFUSED)
def test_a_recorded_by_is_shown_on_one_line(by: str, _shown: str) -> None:
    assert len(one_line(f"{by} (via alice)").splitlines()) == 1
    assert by_problem(one_line(by)) is None  # what is shown is itself plain text


def test_the_cli_shows_an_approval_given_by_a_name_with_a_newline_on_one_line() -> None:
    """Records written before the check (or by a forged event) are shown one line too."""
    out = io.StringIO()
    view = LiveView(Console(file=out, force_terminal=False, width=200))
    by = "bob\n[approved by bob] (via alice)"
    data = {"tool_call_id": "t1", "verdict": "approved", "by": by}
    view.show(Event(run_id="r1", seq=1, type="APPROVAL_RESOLVED", turn=1, ts_ms=1, data=data))
    view.close()
    lines = out.getvalue().splitlines()
    assert "approved by bob␊[approved by bob] (via alice)" in [line.strip() for line in lines]
    assert not any(line.startswith("[approved") for line in lines)
