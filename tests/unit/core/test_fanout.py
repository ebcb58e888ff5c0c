"""A fan-out's copies and its one merged result: a table of texts, and properties (every
machine in exactly one group; the text bounded whatever the fleet and outputs)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmdop_worker.core.fanout import (
    batch_number,
    batches,
    copy_id,
    copy_input,
    copy_machine,
    fanout_text,
    is_copy,
    label_groups,
    merged_outcome,
    name_runs,
    outcome_groups,
    parent_id,
)
from cmdop_worker.models import ToolOutcome, ToolStatus, Usage


def out(
    machine: str, output: str, status: ToolStatus = "ok", **more: object
) -> tuple[str, ToolOutcome]:
    cid = copy_id("toolu_1", machine)
    return machine, ToolOutcome(
        tool_use_id=cid,
        tool="execute_command",
        machine=machine,
        status=status,
        output=output,
        **more,
    )


DISK = "exit_code: 0\n--- stdout ---\n/ 23% used"


def test_copy_ids_are_derived_and_reversible() -> None:
    cid = copy_id("toolu_01AbC", "web-01")
    assert cid == copy_id("toolu_01AbC", "web-01")
    assert (parent_id(cid), copy_machine(cid), is_copy(cid)) == ("toolu_01AbC", "web-01", True)
    assert (parent_id("toolu_x"), copy_machine("toolu_x"), is_copy("toolu_x")) == (
        "toolu_x",
        None,
        False,
    )


def test_copy_input_is_addressed_to_one_machine() -> None:
    args = {"command": "df -h /", "machines": "role=web"}
    assert copy_input(args, "web-1") == {"command": "df -h /", "machine": "web-1"}


@pytest.mark.parametrize(
    ("names", "items"),
    [
        (["web-01", "web-02", "web-03"], ["web-01…web-03"]),
        (["web-01", "web-02"], ["web-01", "web-02"]),
        (["web-1", "web-2", "web-3", "web-5"], ["web-1…web-3", "web-5"]),
        (["a", "b", "c"], ["a", "b", "c"]),
        (["db-1", "web-1", "web-2", "web-3"], ["db-1", "web-1…web-3"]),
        (["web-9", "web-10", "web-11"], ["web-9…web-11"]),
        (["web-09", "web-10", "web-11"], ["web-09…web-11"]),
    ],
)
def test_name_runs(names: list[str], items: list[str]) -> None:
    assert name_runs(names) == items


def test_the_issue_example() -> None:
    copies = [out(f"web-{i:02d}", DISK) for i in range(1, 48)]
    copies.append(out("web-48", "command denied by policy: df", "denied"))
    copies.append(out("db-1", "machine db-1 is offline", "offline"))
    merged = merged_outcome("toolu_1", "execute_command", copies)
    assert merged.tool_use_id == "toolu_1" and merged.status == "ok" and merged.machine is None
    assert merged.output.splitlines() == [
        "execute_command on 49 machines: 47 ok, 1 denied, 1 offline",
        'web-01…web-47 (47): ok, exit 0: "/ 23% used"',
        'db-1 (1): offline: "machine db-1 is offline"',
        'web-48 (1): denied: "command denied by policy: df"',
    ]


@pytest.mark.parametrize(
    ("copies", "status", "lines"),
    [
        (
            [out("a", "exit_code: 1\n--- stderr ---\nno", "error"), out("b", "lost", "lost")],
            "error",
            ['a (1): error, exit 1: "--- stderr ---\\nno"', 'b (1): lost: "lost"'],
        ),
        ([out("a", "", "timeout")], "timeout", ['a (1): timeout: ""']),
        (
            [out("m2", "x"), out("m1", "x"), out("m1", "y")],  # m1's second outcome ignored
            "ok",
            ['m1, m2 (2): ok: "x"'],
        ),
    ],
)
def test_groups_table(
    copies: list[tuple[str, ToolOutcome]], status: ToolStatus, lines: list[str]
) -> None:
    merged = merged_outcome("toolu_1", "execute_command", copies)
    assert merged.status == status
    assert merged.output.splitlines()[1:] == lines


def test_usage_and_duration_are_the_copies() -> None:
    one = Usage(input_tokens=3, output_tokens=1)
    copies = [out("a", "x", usage=one, duration_ms=5), out("b", "y", usage=one, duration_ms=9)]
    merged = merged_outcome("toolu_1", "ask", copies)
    assert merged.usage == one + one and merged.duration_ms == 9


def test_many_distinct_outcomes_are_counted_past_the_budget() -> None:
    copies = [out(f"m{i}", f"output {i} " + "z" * 500) for i in range(400)]
    text = merged_outcome("toolu_1", "execute_command", copies, max_chars=4000).output
    assert len(text) <= 4000
    assert text.splitlines()[-1].startswith("… ") and "machines): " in text.splitlines()[-1]
    assert text.splitlines()[0] == "execute_command on 400 machines: 400 ok"


def test_label_groups() -> None:
    labels = {"w1": {"role": "web"}, "w2": {"role": "web"}, "d": {"role": "db", "env": "prod"}}
    assert label_groups(labels) == "label groups online: role=web (2), env=prod (1), role=db (1)"
    assert label_groups({"a": {}}) == "no machine online has labels"


_names = st.from_regex(r"\A[a-z]{1,3}-?[0-9]{0,3}\Z", fullmatch=True)
_statuses = st.sampled_from(["ok", "error", "denied", "offline", "timeout", "lost", "cancelled"])
_outputs = st.one_of(st.sampled_from(["", DISK, "exit_code: 2"]), st.text(max_size=3000))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(_names, _statuses, _outputs), max_size=120),
    st.integers(min_value=300, max_value=9000),
)
def test_every_machine_in_one_group_and_the_text_bounded(
    rows: list[tuple[str, ToolStatus, str]], max_chars: int
) -> None:
    copies = [out(name, output, status) for name, status, output in rows]
    groups = outcome_groups(copies)
    grouped = [m for g in groups for m in g.machines]
    assert sorted(grouped) == sorted({name for name, _, _ in rows})
    first = {}
    for name, status, output in rows:
        first.setdefault(name, (status, output))
    assert all(first[m] == (g.status, g.output) for g in groups for m in g.machines)
    text = fanout_text("execute_command", groups, max_chars=max_chars)
    assert len(text) <= max_chars
    assert text.startswith(f"execute_command on {len(first)} machine")


@pytest.mark.parametrize(
    ("ids", "serial", "plan"),
    [
        (["a@1", "a@2", "a@3"], None, {}),
        (["a@1", "a@2", "a@3"], 3, {}),
        (["a@1", "a@2", "a@3"], 2, {"a": [["a@1", "a@2"], ["a@3"]]}),
        (["x", "a@1", "b@1", "a@2", "b@2"], 1, {"a": [["a@1"], ["a@2"]], "b": [["b@1"], ["b@2"]]}),
    ],
)
def test_batches(ids: list[str], serial: int | None, plan: dict[str, list[list[str]]]) -> None:
    assert batches(ids, serial) == plan


def test_batch_number() -> None:
    plan = batches(["a@1", "a@2", "a@3", "b@1"], 2)
    assert batch_number(plan) == {"a@1": 0, "a@2": 0, "a@3": 1}


def test_a_keyed_copy_id_names_its_call_and_machine_but_needs_the_runs_key() -> None:
    keyed = copy_id("toolu_1", "web-1", "k" * 32)
    assert keyed.startswith("toolu_1@web-1#") and len(keyed) == len("toolu_1@web-1#") + 16
    assert copy_id("toolu_1", "web-1", "k" * 32) == keyed  # derived: a re-sent turn agrees
    assert copy_id("toolu_1", "web-1", "j" * 32) != keyed
    assert copy_machine(keyed) == "web-1" and parent_id(keyed) == "toolu_1"
    # Without the key, a machine's guess from its own id is another id altogether.
    assert copy_id("toolu_1", "web-2") != copy_id("toolu_1", "web-2", "k" * 32)
    assert copy_machine("toolu_1@db#1") == "db#1"  # only a 16-hex tag is taken off
