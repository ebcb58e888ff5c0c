"""Dollars through the session fleet: every model call priced, children included, and
a `budget_usd` that ends a run (and starves its children) when it is spent.

Expected costs are genai-prices' own numbers for the usage the fake server recorded
for each call, never constants.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import genai_prices
import pytest

from cmdop_worker.core.history import is_valid_history
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import Event
from tests.integration.test_child_runs import ask_then_report, children_of, state_of, use

pytestmark = pytest.mark.integration

TEXT = {"type": "text", "text": "done: {{results}}"}


def echo(word: str) -> dict[str, Any]:
    return {"type": "tool_use", "name": "execute_command", "input": {"command": f"echo {word}"}}


def price_of(records: list[dict[str, Any]]) -> float:
    """genai-prices' price of the calls the fake server answered."""
    total = Decimal(0)
    answered = [r for r in records if r["response"] and r["response"].get("usage")]
    assert answered, "no answered model call was recorded"
    for record in answered:
        usage = record["response"]["usage"]
        read, written = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
        tokens = genai_prices.Usage(
            input_tokens=usage["input_tokens"] + read + written,  # genai-prices counts all
            cache_read_tokens=read,
            cache_write_tokens=written,
            output_tokens=usage["output_tokens"],
        )
        model = record["body"]["model"]
        total += genai_prices.calc_price(tokens, model, provider_id="anthropic").total_price
    return float(total)


def terminal(events: list[Event]) -> Event:
    (last,) = [e for e in events if e.is_terminal]
    return last


def test_done_and_the_result_carry_the_runs_cost(client, script) -> None:
    prompt = script([[echo("one")], [echo("two")], [TEXT]])
    run = client.submit(prompt=prompt, machine="alpha")
    result = run.wait(timeout=60)
    records = script.requests_for(prompt)
    assert len(records) == 3
    assert records[1]["response"]["usage"]["cache_read_input_tokens"] > 0  # cache rates used
    assert result.usage.cost_usd == pytest.approx(price_of(records), rel=1e-9)
    done = terminal(list(run.events()))
    assert done.type == "DONE"
    assert done.data["usage"]["cost_usd"] == pytest.approx(result.usage.cost_usd, rel=1e-12)


def test_a_runs_cost_includes_its_children(client, script) -> None:
    child = script([[echo("child")], [{"type": "text", "text": "child says {{results}}"}]])
    prompt = script(ask_then_report(use("ask_machine", machine="beta", prompt=child)))
    result = client.submit(prompt=prompt).wait(timeout=60)
    assert result.status == "done" and "child says exit_code: 0" in result.text
    own, childs = script.requests_for(prompt), script.requests_for(child)
    assert (len(own), len(childs)) == (2, 2)
    assert result.usage.cost_usd == pytest.approx(price_of(own + childs), rel=1e-9)
    child_state = state_of(client, children_of(client, result.run_id)[0])
    assert child_state.usage.cost_usd == pytest.approx(price_of(childs), rel=1e-9)
    # Tokens too: the child's output tokens are in the parent's count.
    output_tokens = sum(r["response"]["usage"]["output_tokens"] for r in own + childs)
    assert result.usage.output_tokens == output_tokens
    # The model is shown the child's answer, not its bookkeeping.
    assert "cost_usd" not in str(own[1]["body"]["messages"][-1])


def test_a_spent_budget_ends_the_run_after_the_turn_with_valid_history(client, script) -> None:
    prompt = script([[{"type": "text", "text": "first"}, echo("one")], [echo("two")], [TEXT]])
    run = client.submit(prompt=prompt, machine="alpha", budget_usd=1e-6)
    result = run.wait(timeout=60)
    assert (result.status, result.stop_reason, result.turns) == ("done", "budget", 1)
    records = script.requests_for(prompt)
    assert len(records) == 1  # the turn that spent it ran its tools; no second call
    assert result.usage.cost_usd == pytest.approx(price_of(records), rel=1e-9)
    assert result.usage.cost_usd > 1e-6
    assert is_valid_history(result.messages) == []
    assert result.messages[-1].role == "user"  # the turn's tool result is in
    done = terminal(list(run.events()))
    assert done.data["stop_reason"] == "budget" and done.data["usage"]["cost_usd"] > 0


def test_a_child_draws_from_its_parents_remainder(client, script) -> None:
    child = script([[{"type": "text", "text": "child done"}]])
    prompt = script(ask_then_report(use("ask_machine", machine="alpha", prompt=child)))
    budget_usd = 5.0
    result = client.submit(prompt=prompt, budget_usd=budget_usd).wait(timeout=60)
    assert result.status == "done"
    child_state = state_of(client, children_of(client, result.run_id)[0])
    spent_before_ask = price_of(script.requests_for(prompt)[:1])
    assert child_state.request.budget_usd == pytest.approx(budget_usd - spent_before_ask)


def test_no_child_starts_once_the_parents_budget_is_spent(client, script) -> None:
    child = script([[{"type": "text", "text": "never asked"}]])
    prompt = script(ask_then_report(use("ask_machine", machine="alpha", prompt=child)))
    result = client.submit(prompt=prompt, budget_usd=1e-6).wait(timeout=60)
    assert (result.status, result.stop_reason) == ("done", "budget")
    assert children_of(client, result.run_id) == [] and script.requests_for(child) == []
    answer = result.messages[-1].content[0]
    assert answer["is_error"] and "budget_usd is spent" in answer["content"]


def test_cancelled_carries_the_cost_so_far(client, script) -> None:
    call = {"type": "tool_use", "name": "execute_command", "input": {"command": "sleep 30"}}
    prompt = script([[call], [TEXT]])
    run = client.submit(prompt=prompt, machine="alpha")
    for event in run.events():
        if event.type == "TOOL_START":
            run.cancel(ui=True)
            break
    result = run.wait(timeout=30, raise_on_failure=False)
    cancelled = terminal(list(run.events()))
    assert result.status == "cancelled" and cancelled.type == "CANCELLED"
    expected = price_of(script.requests_for(prompt))
    assert cancelled.data["usage"]["cost_usd"] == pytest.approx(expected, rel=1e-9)


def test_a_model_without_a_price_has_an_unknown_cost_and_refuses_a_budget(
    turn_harness, script
) -> None:
    client = turn_harness.client  # the coordinator alone prices, in this process
    model = f"claude-unpriced-{uuid.uuid4().hex[:6]}"
    prompt = script([[{"type": "text", "text": "hello"}]])
    result = client.submit(prompt=prompt, model=model).wait(timeout=60)
    assert result.status == "done" and result.usage.output_tokens > 0
    assert result.usage.cost_usd is None  # unknown, not free
    refused = client.submit(prompt=prompt, model=model, budget_usd=1.0)
    with pytest.raises(InvalidRequest, match=r"budget_usd: model 'claude-unpriced-"):
        refused.wait(timeout=30)
