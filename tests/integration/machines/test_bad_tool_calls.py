"""Calls the model gets wrong: a tool that does not exist, input that breaks the
schema, input that is not an object. Each is an error result and the run goes on."""

from __future__ import annotations

import time

import pytest

from cmdop_worker.machine.registry import ToolContext, default_registry

from .machine_runs import (
    calls_then_report,
    finish,
    use,
)

pytestmark = pytest.mark.integration


def test_hallucinated_tool_is_an_error_result_and_the_run_goes_on(client, script) -> None:
    prompt = script(
        calls_then_report(use("frobnicate_cluster", machine="alpha"), use("list_machines"))
    )
    done = finish(client, prompt)
    assert done.result.status == "done" and done.result.turns == 2
    bad, good = done.ends_in_call_order()
    assert bad.data["is_error"] and bad.data["output"] == "tool 'frobnicate_cluster' does not exist"
    assert not good.data["is_error"]
    assert "does not exist" in done.result.text


@pytest.mark.parametrize(
    ("tool_input", "problem"),
    [
        ({"machine": "alpha"}, "invalid arguments for read_file: path: Field required"),
        ({"machine": "alpha", "path": 42}, "path: Input should be a valid string"),
        ({"machine": "alpha", "path": "/etc/hostname", "limit": 0}, "limit: Input should be"),
        ({"machine": "alpha", "path": "/etc/hostname", "colour": 1}, "colour: Extra inputs"),
        ({"machine": 7, "path": "/etc/hostname"}, "'7' is not a valid machine name"),
    ],
)
def test_schema_violations_are_error_results_naming_the_problem(
    client, script, tool_input, problem
) -> None:
    prompt = script(calls_then_report(use("read_file", **tool_input)))
    done = finish(client, prompt)
    (end,) = done.ends
    assert end.data["is_error"] and end.data["status"] == "invalid"
    assert problem in end.data["output"]
    assert done.result.status == "done"


@pytest.mark.parametrize("raw", ['["a", "b"]', '"just text"', "{not json"])
def test_non_object_input_is_an_error_naming_the_problem(raw) -> None:
    # The model API only yields objects (the coordinator repairs anything else before
    # routing); the machine side must still answer a raw non-object with data.
    import threading

    ctx = ToolContext(
        machine="alpha",
        run_id="r",
        tool_use_id="toolu_raw",
        deadline_monotonic=time.monotonic() + 5,
        cancelled=threading.Event(),
    )
    outcome = default_registry().run("read_file", raw, ctx)
    assert outcome.status == "invalid"
    assert outcome.output.startswith("invalid ")
    assert "read_file" in outcome.output
