"""Before a turn's model call: whether to make it, and the call to make.

Called by `coordinator.turn.execute_turn`. `decide_before_model` gathers the run's
facts (its cancel request, the clock) for the core's `step_before_model`: the call, or
the run's end (turn limit, budget, cancel, deadline). `prepare_call` builds the
`ModelCall`: the tools this turn offers (the fleet's catalogue, hidden tools, the
intent router's DIRECT answer), the history within the context window, the request
(`core.request`), and eager dispatch when the reply's calls may go out as it streams.
The decisions are the pure core's; this module reads what they need.
"""

from __future__ import annotations

import logging
from typing import Any

from cmdop_worker.coordinator import eager
from cmdop_worker.coordinator.eager import EarlySender
from cmdop_worker.coordinator.model_call import ModelCall
from cmdop_worker.coordinator.turn_context import TurnContext
from cmdop_worker.core.catalog import resolve_tools
from cmdop_worker.core.clearing import clear_old_results
from cmdop_worker.core.context import system_prompt, turn_reminder
from cmdop_worker.core.history import sanitize_history
from cmdop_worker.core.intent import classifier_request, has_tool_blocks, parse_intent
from cmdop_worker.core.request import build_request
from cmdop_worker.core.step import CallModel, Cancelled, Finish, TurnFacts, step_before_model
from cmdop_worker.models import ToolSpec
from cmdop_worker.runtime import now_ms
from cmdop_worker.state.events import turn_text
from cmdop_worker.state.store import RunState

log = logging.getLogger(__name__)


def decide_before_model(ctx: TurnContext) -> CallModel | Finish | Cancelled:
    """May this turn call the model, or does the run end here?"""
    state = ctx.state
    facts = TurnFacts(
        turn=ctx.turn,
        max_turns=state.max_turns,
        usage=state.usage,
        token_budget=state.token_budget,
        last_text=_last_text(state),
        cancel=ctx.rt.store.cancel_request(ctx.run_id),
        now_ms=now_ms(),
        deadline_ms=state.deadline_ms,
        budget_usd=state.request.budget_usd,
    )
    return step_before_model(facts)


def prepare_call(ctx: TurnContext) -> ModelCall:
    """The turn's model call: its request, and how its reply is to be taken."""
    rt, state = ctx.rt, ctx.state
    tools = resolve_tools(
        ctx.fleet.catalog,
        turn=ctx.turn,
        tool_tags=state.tool_tags,
        hidden=ctx.fleet.hidden,
        direct=_is_direct(ctx),
    )
    state = _within_context(ctx)  # stored with this turn's reply
    request = _request(ctx, state, tools)
    called_ms = now_ms()
    wanted = tools and eager.wanted(rt, state)
    early = EarlySender(rt, state, ctx.turn, ctx.fleet) if wanted else None
    # Text of this turn already streamed to clients exists only if it ran before.
    seen = "" if ctx.first_attempt else turn_text(rt.redis, rt.keys, ctx.run_id, ctx.turn)
    stream = state.request.stream if state.request.stream is not None else rt.settings.stream
    return ModelCall(state, request, stream, seen, early, called_ms)


def _is_direct(ctx: TurnContext) -> bool:
    """Whether the intent router says this turn needs no tools."""
    from cmdop_worker.llm.client import model_client

    settings, history = ctx.rt.settings, ctx.state.history
    if not settings.intent_router or has_tool_blocks(history):
        # The API refuses tool_use/tool_result blocks in a request without tools.
        return False
    model = settings.resolve_model(settings.router_model)
    answer = model_client(ctx.rt).classify(classifier_request(model, history), timeout_s=10.0)
    return parse_intent(answer) == "DIRECT"


def _request(ctx: TurnContext, state: RunState, tools: list[ToolSpec]) -> dict[str, Any]:
    settings = ctx.rt.settings
    system = system_prompt(agent_prompt=state.system_prompt, platform=state.request.platform)
    reminder = turn_reminder(
        host=ctx.rt.host,
        target_machine=state.request.machine,
        has_tools=bool(tools),
        turn=ctx.turn,
        max_turns=state.max_turns,
    )
    return build_request(
        model=state.model,
        system=system,
        reminder=reminder,
        history=sanitize_history(state.history),
        tools=tools,
        temperature=settings.temperature,
        max_tokens=settings.max_tokens,
        thinking=state.thinking,
        cache_ttl=settings.cache_ttl,
    )


def _within_context(ctx: TurnContext) -> RunState:
    """The run's state with old tool results cleared when its history is over the
    threshold."""
    state = ctx.state
    clearing = clear_old_results(state.history, max_tokens=ctx.rt.settings.context_max_tokens)
    if not clearing.changed:
        return state
    log.info(
        "run %s turn %s: cleared %d old tool results, removed %d old messages (~%d -> ~%d tokens)",
        state.run_id,
        ctx.turn,
        clearing.cleared,
        clearing.dropped,
        clearing.tokens_before,
        clearing.tokens_after,
    )
    return state.model_copy(update={"history": clearing.history})


def _last_text(state: RunState) -> str:
    for message in reversed(state.history):
        if message.role == "assistant":
            if isinstance(message.content, str):
                return message.content
            return "".join(b.get("text", "") for b in message.content if b.get("type") == "text")
    return ""
