"""Dollars and the request fixes, in the pure parts: cost arithmetic, the dollar budget,
a child's share of it, pricing by `genai-prices`, cut-off calls, request intake."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import genai_prices
import pytest
from genai_prices import data_snapshot

from cmdop_worker.core.children import child_budget_usd
from cmdop_worker.core.intake import parse_request
from cmdop_worker.core.step import (
    CUT_OFF,
    CallModel,
    Finish,
    ModelReply,
    RunTools,
    TurnFacts,
    normalize_reply,
    step_after_model,
    step_before_model,
)
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.llm.pricing import has_price, priced
from cmdop_worker.models import MAX_PROMPT_CHARS, Usage

FACTS = TurnFacts(
    turn=2,
    max_turns=5,
    usage=Usage(input_tokens=10, cost_usd=0.5),
    token_budget=1_000,
    last_text="so far",
    cancel=None,
    now_ms=1_000,
    deadline_ms=2_000,
)


# --- cost arithmetic and the budget ---------------------------------------------------


def test_costs_add_up_and_an_unknown_cost_stays_unknown() -> None:
    known = Usage(input_tokens=1, cost_usd=0.25) + Usage(output_tokens=2, cost_usd=0.5)
    assert (known.cost_usd, known.total_tokens) == (0.75, 3)
    assert Usage().cost_usd == 0.0  # no call made: nothing spent
    assert (known + Usage(input_tokens=5, cost_usd=None)).cost_usd is None
    assert (Usage(cost_usd=None) + known).cost_usd is None


@pytest.mark.parametrize(
    ("budget_usd", "cost_usd", "expected"),
    [
        (None, 0.5, CallModel()),
        (None, None, CallModel()),  # no budget: an unknown cost stops nothing
        (0.6, 0.5, CallModel()),
        (0.5, 0.5, Finish("so far", "budget")),
        (0.4, 0.5, Finish("so far", "budget")),
        (10.0, None, Finish("so far", "budget")),  # a cap that cannot be checked
    ],
)
def test_a_spent_dollar_budget_ends_the_run_before_the_next_call(
    budget_usd: float | None, cost_usd: float | None, expected: object
) -> None:
    usage = Usage(input_tokens=10, cost_usd=cost_usd)
    assert step_before_model(replace(FACTS, usage=usage, budget_usd=budget_usd)) == expected


@pytest.mark.parametrize(
    ("budget_usd", "spent_usd", "children", "share"),
    [
        (None, 0.3, 2, None),
        (1.0, 0.25, 1, 0.75),
        (1.0, 0.25, 3, 0.25),
        (1.0, 1.5, 2, 0.0),  # overspent: nothing left to share
        (1.0, None, 2, 0.0),  # unknown spend: no child may start
        (1.0, 0.0, 0, 1.0),
    ],
)
def test_a_child_draws_a_share_of_its_parents_remainder(
    budget_usd: float | None, spent_usd: float | None, children: int, share: float | None
) -> None:
    assert child_budget_usd(budget_usd, spent_usd, children) == pytest.approx(share)


# --- pricing with genai-prices ----------------------------------------------------------


def expected_price(usage: Usage, model: str) -> float:
    tokens = genai_prices.Usage(
        input_tokens=usage.input_tokens
        + usage.cache_read_input_tokens
        + usage.cache_creation_input_tokens,
        cache_read_tokens=usage.cache_read_input_tokens,
        cache_write_tokens=usage.cache_creation_input_tokens,
        output_tokens=usage.output_tokens,
    )
    return float(genai_prices.calc_price(tokens, model, provider_id="anthropic").total_price)


@pytest.mark.parametrize("model", ["claude-sonnet-5-5", "claude-haiku-4-5", "claude-opus-4-1"])
def test_a_call_is_priced_with_its_cache_reads_and_writes(model: str) -> None:
    usage = Usage(
        input_tokens=1_200,
        output_tokens=300,
        cache_read_input_tokens=40_000,
        cache_creation_input_tokens=5_000,
    )
    cost = priced(usage, model, at_ms=int(time.time() * 1000)).cost_usd
    assert cost == pytest.approx(expected_price(usage, model), rel=1e-12)
    # The cache rates are applied: the same tokens uncached cost more.
    uncached = Usage(input_tokens=46_200, output_tokens=300)
    assert cost is not None and cost < expected_price(uncached, model)


def test_a_model_without_a_price_costs_unknown_not_nothing() -> None:
    assert not has_price("claude-made-up-9")
    assert priced(Usage(input_tokens=10), "claude-made-up-9", at_ms=0).cost_usd is None
    assert has_price("claude-sonnet-5-5")


def test_prices_come_from_the_bundled_table_never_an_update() -> None:
    priced(Usage(input_tokens=10), "claude-sonnet-5-5", at_ms=int(time.time() * 1000))
    assert data_snapshot.get_snapshot().from_auto_update is False


# --- a call cut off by max_tokens ---------------------------------------------------------


def tool_use(tool_id: str, **tool_input: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id, "name": "execute_command", "input": tool_input}


def test_a_last_call_cut_off_by_max_tokens_is_answered_not_run() -> None:
    content = [
        {"type": "text", "text": "two calls"},
        tool_use("toolu_a", command="echo whole"),
        tool_use("toolu_b", command="echo part"),  # as far as the input was read
    ]
    fixed, repairs = normalize_reply(content, turn=1, stop_reason="max_tokens")
    assert fixed == content  # history keeps the call, so its result has a partner
    assert repairs == {"toolu_b": CUT_OFF}
    step = step_after_model(
        ModelReply(fixed, "max_tokens", Usage()),
        output_schema=None,
        output_retry_used=False,
        repairs=repairs,
    )
    assert isinstance(step, RunTools)  # the turn goes on; the cut call is refused
    assert [t["id"] for t in step.tool_uses] == ["toolu_a", "toolu_b"]


@pytest.mark.parametrize("stop_reason", ["tool_use", "end_turn", None])
def test_calls_of_a_reply_that_was_not_cut_off_are_kept(stop_reason: str | None) -> None:
    content = [tool_use("toolu_a", command="echo whole")]
    assert normalize_reply(content, turn=1, stop_reason=stop_reason)[1] == {}


def test_text_after_the_calls_means_they_were_complete() -> None:
    content = [tool_use("toolu_a", command="echo whole"), {"type": "text", "text": "and"}]
    assert normalize_reply(content, turn=1, stop_reason="max_tokens")[1] == {}


# --- request intake ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "objekt"}, "output_schema.type"),
        ({"type": "object", "required": "name"}, "output_schema.required"),
        ({"properties": {"n": {"type": "integer", "minimum": "0"}}}, "output_schema.properties"),
        ({"$schema": "http://json-schema.org/draft-07/schema#", "items": 3}, "output_schema.items"),
    ],
)
def test_a_bad_output_schema_is_refused_at_intake(schema: dict[str, Any], where: str) -> None:
    with pytest.raises(InvalidRequest, match="not a valid JSON Schema") as caught:
        parse_request({"prompt": "hi", "output_schema": schema})
    assert str(caught.value).startswith(where)


def test_a_good_output_schema_passes_intake() -> None:
    schema = {"type": "object", "properties": {"ok": True}, "required": ["ok"]}
    assert parse_request({"prompt": "hi", "output_schema": schema}).output_schema == schema


def test_messages_have_the_prompts_size_limit() -> None:
    half = "x" * (MAX_PROMPT_CHARS // 2 + 1)
    too_much = [
        {"role": "user", "content": half},
        {"role": "assistant", "content": [{"type": "text", "text": half}]},
    ]
    with pytest.raises(InvalidRequest, match=r"messages: .*longer than"):
        parse_request({"messages": too_much})
    assert parse_request({"messages": too_much[:1]}).messages is not None


def test_budget_usd_must_be_positive() -> None:
    with pytest.raises(InvalidRequest, match="budget_usd"):
        parse_request({"prompt": "hi", "budget_usd": 0})
    assert parse_request({"prompt": "hi", "budget_usd": 0.05}).budget_usd == 0.05
