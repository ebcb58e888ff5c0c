"""Tools the coordinator runs itself: `list_machines`, `ask_machine`, `ask_machines`.

Called from `calls.start_calls` for calls routed `ToCoordinator`, and through the
`cmdop.local_tool` task (`run_queued`) for one that is next in a sequential turn or
re-sent by recovery. `list_machines` answers at once from the presence keys (those
its `selector` matches).
`ask_machine(s)` start child runs targeted at each host (`parent` link in the child's
state; `ask_machines` names its hosts, or picks with a label selector those online);
each child's end is handed back through `answer_parent`, and when every host of the
call has answered, one outcome — each host's response, remote error or local
error — is recorded on the parent's turn. Hosts that are offline answer at once with a
local error; a host that runs out of time answers "timeout"; a parent cancel reaches its
children through `cancel_children`.

A child runs under its parent's limits: the same agent, platform and mode (so the same
hide map), the parent's resolved tool tags and parallelism, its fan-out limits in effect
(`max_fanout`, `serial`: a child's fan-out is no wider, nor its batches larger), and a
share of what the parent has left of its turns, tokens and dollars (`core.children`;
with no dollars left, no child starts). A child's usage, its cost and its own
children's included, comes back with its answer (`ToolOutcome.usage`) and is added to
the parent's when the parent collects the turn's results. A child deeper than
`max_run_depth` (CMDOP_MAX_RUN_DEPTH; a top-level run is depth 0) is never started:
each host of that call answers with a local error naming the limit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from typing import Any

from cmdop_worker.coordinator.runs import default_max_turns, start_run
from cmdop_worker.core.children import (
    BUDGET_SPENT,
    ChildLimits,
    child_budget_usd,
    child_limits,
    host_problem,
)
from cmdop_worker.core.event_data import ToolStartData
from cmdop_worker.core.fanout import label_groups, name_key
from cmdop_worker.core.machine_names import unknown_machine
from cmdop_worker.core.results import unanswered
from cmdop_worker.core.routing import ToCoordinator, clamp_timeout_ms
from cmdop_worker.core.selectors import SelectorError, selected, selector_argument
from cmdop_worker.core.tools import ASK_MANY_HOST_MAX_MS, ASK_MANY_MAX_HOSTS, ASK_TIMEOUT_DEFAULT_MS
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import CancelRequest, RunResult, ToolOutcome, ToolStatus, Usage
from cmdop_worker.outcomes import record
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.presence import online_machines
from cmdop_worker.state.seen import seen_names
from cmdop_worker.state.store import ParentLink, RunState, Started, tool_inputs

log = logging.getLogger(__name__)


def run_local(rt: Runtime, state: RunState, turn: int, route: ToCoordinator) -> None:
    if route.tool == "list_machines":
        record(rt, state.run_id, turn, _list_machines(rt, route), tool_input=route.input)
        return
    problem = _ask_problem(route)
    hosts: list[str] = []
    if problem is None:
        hosts, problem = _hosts(rt, route)
    if problem is not None:
        outcome = unanswered(route, "invalid", problem)
        record(rt, state.run_id, turn, outcome, tool_input=route.input)
        return

    # Started once, like a machine call: a second delivery starts no second set of
    # children, and a ui cancel that came first keeps it from starting at all.
    data = ToolStartData.of(route, machine=None, input=route.input)
    started, _ = rt.store.start_call(
        state.run_id,
        turn,
        route.tool_use_id,
        f"coordinator:{rt.host.hostname}:{os.getpid()}",
        deadline_passed=now_ms() >= state.deadline_ms,
        start_event=rt.events.frame(state.run_id, turn, data),
    )
    if started is Started.CANCELLED:
        outcome = unanswered(route, "cancelled", "cancelled before it started")
        record(rt, state.run_id, turn, outcome, tool_input=route.input)
    elif started is Started.FIRST:
        _ask(rt, state, turn, route, hosts)


def run_queued(
    rt: Runtime, run_id: str, turn: int, tool_use_id: str, *, deadline_ms: int | None = None
) -> None:
    """Run a coordinator tool of a sequential turn whose turn has come (or one recovery
    re-sends), if its run is still on that turn and the call has no outcome yet; by
    `deadline_ms`, set when it was handed out (else the one planned at dispatch)."""
    state = rt.store.load(run_id)
    if state is None or state.status != "running" or state.turn != turn:
        return
    queued = rt.store.queued_call(run_id, turn, tool_use_id)
    call = next((c for c in state.awaiting if c.tool_use_id == tool_use_id), None)
    if call is None or rt.store.outcome(run_id, turn, tool_use_id) is not None:
        return
    tool_input = queued.input if queued is not None else tool_inputs(state).get(tool_use_id)
    route = ToCoordinator(
        tool_use_id,
        call.tool,
        tool_input if isinstance(tool_input, dict) else {},
        deadline_ms or call.deadline_ms,
    )
    run_local(rt, state, turn, route)


def _list_machines(rt: Runtime, route: ToCoordinator) -> ToolOutcome:
    try:
        chosen = selector_argument(route.input.get("selector"))
    except SelectorError as exc:
        return unanswered(route, "invalid", f"invalid arguments for list_machines: {exc}")
    found = selected(online_machines(rt.redis, rt.keys), chosen)
    shown = {"machine", "labels", "host"}
    machines = [p.model_dump(include=shown) | {"tools": [t.name for t in p.tools]} for p in found]
    return ToolOutcome(
        tool_use_id=route.tool_use_id, tool=route.tool, output=json.dumps(machines, indent=1)
    )


def _ask_problem(route: ToCoordinator) -> str | None:
    prompt = route.input.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return f"invalid arguments for {route.tool}: prompt: a non-empty string is required"
    hosts = (
        route.input.get("machine") if route.tool == "ask_machine" else route.input.get("machines")
    )
    if route.tool == "ask_machine" and not isinstance(hosts, str):
        return "invalid arguments for ask_machine: machine: a machine name is required"
    if route.tool == "ask_machines" and (not isinstance(hosts, list | str) or not hosts):
        return (
            "invalid arguments for ask_machines: machines: a non-empty list of names, "
            "or a label selector, is required"
        )
    return None


def hosts_of(route: ToCoordinator) -> list[str]:
    """The hosts a call names, de-duplicated in order."""
    raw = [route.input["machine"]] if route.tool == "ask_machine" else route.input["machines"]
    return list(dict.fromkeys(str(h) for h in raw))


def _hosts(rt: Runtime, route: ToCoordinator) -> tuple[list[str], str | None]:
    """The hosts a call asks, or why none: an ask_machines selector picks the machines
    online it matches, in name order, at most `ASK_MANY_MAX_HOSTS`."""
    text = route.input.get("machines")
    if route.tool != "ask_machines" or not isinstance(text, str):
        return hosts_of(route), None
    why = "invalid arguments for ask_machines: machines"
    try:
        chosen = selector_argument(text)
    except SelectorError as exc:
        return [], f"{why}: {exc}"
    presences = online_machines(rt.redis, rt.keys)
    found = sorted((p.machine for p in selected(presences, chosen)), key=name_key)
    if not found:
        groups = label_groups({p.machine: p.labels for p in presences})
        return [], f"no machine online matches the selector '{text}'; {groups}"
    if len(found) > ASK_MANY_MAX_HOSTS:
        return [], (
            f"the selector '{text}' matches {len(found)} machines; ask_machines starts at "
            f"most {ASK_MANY_MAX_HOSTS} runs: narrow it, or give the same command to every "
            "machine with a machine-bound tool's `machines`"
        )
    return found, None


def _per_host_ms(route: ToCoordinator) -> int:
    per_host_ms = clamp_timeout_ms(route.input.get("timeout_ms"), ASK_TIMEOUT_DEFAULT_MS)
    if route.tool == "ask_machines":
        per_host_ms = min(per_host_ms, ASK_MANY_HOST_MAX_MS)
    return max(1, min(per_host_ms, route.deadline_ms - now_ms()))


def _ask(rt: Runtime, state: RunState, turn: int, route: ToCoordinator, hosts: list[str]) -> None:
    # The hosts in the call's order: answers arrive in any order (and a Redis hash keeps
    # none once its values grow), but the outcome lists them as the model asked.
    rt.redis.set(
        _key(rt, state.run_id, route.tool_use_id, "hosts"),
        json.dumps(hosts),
        ex=rt.settings.run_ttl_s,
    )
    depth, max_depth = state.depth + 1, rt.settings.max_run_depth
    online = {p.machine for p in online_machines(rt.redis, rt.keys)}
    problems = {host: host_problem(host, online, depth, max_depth) for host in hosts}
    if any(host not in online for host in hosts):  # never seen, or only offline now?
        known = seen_names(rt.redis, rt.keys)
        for host in (h for h in hosts if h not in online and h not in known):
            problems[host] = unknown_machine(host, known, online)
    limits = _limits(rt, state, turn, children=sum(p is None for p in problems.values()))
    if limits.budget_usd == 0:
        problems = {host: problem or BUDGET_SPENT for host, problem in problems.items()}
    per_host_ms = _per_host_ms(route)
    for host, problem in problems.items():
        link = ParentLink(
            run_id=state.run_id,
            turn=turn,
            tool_use_id=route.tool_use_id,
            tool=route.tool,
            host=host,
            depth=depth,
        )
        if problem is not None:
            _answer(rt, link, {"host": host, "status": "local_error", "error": problem})
            continue
        _start_child(rt, state, route, link, per_host_ms, limits)


def _limits(rt: Runtime, state: RunState, turn: int, *, children: int) -> ChildLimits:
    limits = child_limits(
        parent_max_turns=state.max_turns,
        parent_turn=turn,
        parent_token_budget=state.token_budget,
        # The same count the budget check stops the parent on (`core.step`).
        parent_tokens_used=state.usage.total_tokens,
        children=children,
        own_max_turns=default_max_turns(rt, rt.agents.get(state.request.agent)),
        own_token_budget=rt.settings.run_token_budget,
    )
    # The parent's spend so far includes this turn's reply and earlier children.
    budget_usd = child_budget_usd(state.request.budget_usd, state.usage.cost_usd, children)
    return dataclasses.replace(limits, budget_usd=budget_usd)


def _start_child(
    rt: Runtime,
    state: RunState,
    route: ToCoordinator,
    link: ParentLink,
    timeout_ms: int,
    limits: ChildLimits,
) -> None:
    child_id = f"{state.run_id[:40]}-ask-{uuid.uuid4().hex[:12]}"
    request = {
        "run_id": child_id,
        "prompt": route.input["prompt"],
        "agent": state.request.agent,
        "machine": link.host,
        "platform": state.request.platform,
        "mode": state.request.mode,
        "tool_tags": state.tool_tags,
        "parallel_tools": state.parallel_tools,
        "max_turns": limits.max_turns,
        "token_budget": limits.token_budget,
        "budget_usd": limits.budget_usd,
        "timeout_s": max(timeout_ms / 1000, 0.001),
        # The parent's fan-out limits bind its child: the request's own, or where it
        # set none the same agent profile's (`calls.fanout_limits`), so no wider.
        "max_fanout": state.request.max_fanout,
        "serial": state.request.serial,
        "parent_run_id": state.run_id,
        "metadata": {"tool": route.tool, "tool_use_id": route.tool_use_id},
    }
    rt.redis.sadd(rt.keys.run(state.run_id, "children"), child_id)
    rt.redis.expire(rt.keys.run(state.run_id, "children"), rt.settings.run_ttl_s)
    try:
        start_run(rt, request, fallback_id=child_id, parent=link)
    except InvalidRequest as exc:  # e.g. a prompt past the limit: answer, never wait
        rt.redis.srem(rt.keys.run(state.run_id, "children"), child_id)
        _answer(rt, link, {"host": link.host, "status": "local_error", "error": str(exc)})


def answer_parent(rt: Runtime, link: ParentLink, result: RunResult) -> None:
    answer = _answer_of(link, result)
    # What the child spent goes back with its answer, whatever its end.
    _answer(rt, link, {**answer, "usage": result.usage.model_dump(mode="json")})


def _answer_of(link: ParentLink, result: RunResult) -> dict[str, Any]:
    if result.status == "done":
        return {"host": link.host, "status": "response", "text": result.text}
    if result.status == "cancelled" and result.stop_reason == "timeout":
        return {"host": link.host, "status": "local_error", "error": "timeout"}
    if result.status == "cancelled":
        return {"host": link.host, "status": "local_error", "error": "cancelled"}
    message = result.error.message if result.error else "failed"
    return {"host": link.host, "status": "remote_error", "error": message}


def _answer(rt: Runtime, link: ParentLink, answer: dict[str, Any]) -> None:
    answers_key = _key(rt, link.run_id, link.tool_use_id, "answers")
    rt.redis.hsetnx(answers_key, link.host, json.dumps(answer))
    rt.redis.expire(answers_key, rt.settings.run_ttl_s)
    hosts = json.loads(rt.redis.get(_key(rt, link.run_id, link.tool_use_id, "hosts")) or "[]")
    answers = {str(h): json.loads(a) for h, a in rt.redis.hgetall(answers_key).items()}
    if not hosts or any(host not in answers for host in hosts):
        return
    ordered = [answers[host] for host in hosts]
    record(rt, link.run_id, link.turn, compose_outcome(link.tool_use_id, link.tool, ordered))


def compose_outcome(tool_use_id: str, tool: str, answers: list[dict[str, Any]]) -> ToolOutcome:
    """One outcome for the call: `answers` are the hosts' answers in the call's order;
    its usage sums theirs (what the model is shown leaves usage out)."""
    usages = [Usage.model_validate(a["usage"]) for a in answers if a.get("usage") is not None]
    usage = sum(usages, Usage()) if usages else None
    shown = [{k: v for k, v in a.items() if k != "usage"} for a in answers]
    return _composed(tool_use_id, tool, shown).model_copy(update={"usage": usage})


def _composed(tool_use_id: str, tool: str, answers: list[dict[str, Any]]) -> ToolOutcome:
    if tool == "ask_machine" and len(answers) == 1:
        (answer,) = answers
        ok = answer["status"] == "response"
        return ToolOutcome(
            tool_use_id=tool_use_id,
            tool=tool,
            machine=answer["host"],
            status="ok" if ok else _failed_status(answer),
            output=answer["text"]
            if ok
            else f"{answer['host']}: {answer['status']}: {answer['error']}",
        )
    failed = all(a["status"] != "response" for a in answers)
    return ToolOutcome(
        tool_use_id=tool_use_id,
        tool=tool,
        status="error" if failed else "ok",
        output=json.dumps(answers, indent=1, ensure_ascii=False),
    )


def _failed_status(answer: dict[str, Any]) -> ToolStatus:
    """The word for a host that did not answer, as any other call would get it."""
    error = str(answer.get("error", ""))
    if answer["status"] == "local_error" and error in ("timeout", "cancelled"):
        return "timeout" if error == "timeout" else "cancelled"
    if answer["status"] == "local_error" and error.endswith("is offline"):
        return "offline"
    if answer["status"] == "local_error" and error.startswith("unknown machine"):
        return "invalid"
    return "error"


def cancel_children(rt: Runtime, run_id: str, cancel: CancelRequest) -> None:
    for child_id in rt.redis.smembers(rt.keys.run(run_id, "children")):
        rt.store.request_cancel(str(child_id), cancel, now_ms=now_ms())


def _key(rt: Runtime, run_id: str, tool_use_id: str, part: str) -> str:
    return rt.keys.ask(run_id, tool_use_id, part)
