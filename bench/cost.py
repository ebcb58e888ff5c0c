"""6. Cost growth: per-turn CPU of the pure core as a run's history grows.

Times, in this process, what the coordinator does on every turn with the whole
history: `sanitize_history` then `build_request` (2 machines' built-in tools, the
real system prompt), and - for context - the run state's JSON round trip
(`RunState.model_validate_json` + `model_dump_json`), which the store does on each
load and save. Histories are a prompt then (assistant: text + 2 tool_use, user: 2
tool_result of ~400 chars) pairs, so sizes are odd (11 ... 1001 messages).

Reported: µs per message at each size, and the linearity check on sanitise + build:
per-message cost at ~1000 messages over that at ~100 (1.0 = linear; 10 would be
quadratic; under 1.5 passes, as caches miss more on a bigger history). The state JSON
ratio is shown beside it for context: a run's whole record is rewritten each turn, so
that part is linear per turn by design. No Redis, no fleet: `python -m bench --quick
--only cost` takes a few seconds.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from bench.common import MODEL, Result
from cmdop_worker.core.catalog import fleet_catalog
from cmdop_worker.core.context import HostFacts, system_prompt, turn_reminder
from cmdop_worker.core.history import sanitize_history
from cmdop_worker.core.request import build_request
from cmdop_worker.machine.registry import default_registry
from cmdop_worker.models import MachinePresence, Message, RunRequest

NAME = "cost"
SIZES = (10, 30, 100, 300, 1000)
HOST = HostFacts(hostname="bench", os_name="Linux", timezone="UTC", user="bench")


def history(size: int) -> list[Message]:
    messages = [Message(role="user", content="check the disks on both machines")]
    for i in range(size // 2):
        uses = [
            {
                "type": "tool_use",
                "id": f"toolu_{i}_{k}",
                "name": "execute_command",
                "input": {"machine": m, "command": f"df -h / # {i}"},
            }
            for k, m in enumerate(("alpha", "beta"))
        ]
        messages.append(
            Message(
                role="assistant",
                content=[
                    {"type": "text", "text": f"Step {i}: looking at both machines again."},
                    *uses,
                ],
            )
        )
        messages.append(
            Message(
                role="user",
                content=[
                    {
                        "type": "tool_result",
                        "tool_use_id": u["id"],
                        "content": "exit_code: 0\n" + "x" * 400,
                    }
                    for u in uses
                ],
            )
        )
    return messages


def per_turn_fn(messages: list[Message]) -> Callable[[], Any]:
    presences = [
        MachinePresence(machine=m, host="h", pid=1, started_ms=0, tools=default_registry().specs())
        for m in ("alpha", "beta")
    ]
    tools = fleet_catalog(presences, [])
    system = system_prompt(agent_prompt="You operate a fleet.", platform=None)
    reminder = turn_reminder(host=HOST, target_machine=None, has_tools=True, turn=3, max_turns=10)

    def one_turn() -> dict[str, Any]:
        return build_request(
            model=MODEL,
            system=system,
            reminder=reminder,
            history=sanitize_history(messages),
            tools=tools,
            temperature=0.3,
            max_tokens=4096,
        )

    return one_turn


def state_roundtrip_fn(messages: list[Message]) -> Callable[[], Any]:
    from cmdop_worker.state.store import RunState

    fields: dict[str, Any] = {
        "run_id": "bench",
        "request": RunRequest(prompt="x"),
        "model": MODEL,
        "system_prompt": "s",
        "max_turns": 10,
        "parallel_tools": True,
        "history": messages,
        "started_ms": 0,
        "deadline_ms": 1,
    }
    # RunState grows fields; give any new required scalar a neutral value.
    for name, info in RunState.model_fields.items():
        if info.is_required() and name not in fields:
            fields[name] = {int: 0, float: 0.0, str: "", bool: False}.get(info.annotation)
    state = RunState(**fields)
    return lambda: RunState.model_validate_json(state.model_dump_json())


def best_time_s(fn: Callable[[], Any], budget_s: float, rounds: int = 5) -> float:
    """The best of `rounds` rounds of mean call time, each ~budget_s / rounds long, with
    the garbage collector off while timing (as `timeit` does): a full collection's
    pause depends on everything alive in the process, not on the code timed, and
    landing in one size's rounds it made the growth look superlinear."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    number = max(1, int(budget_s / rounds / once))
    best = float("inf")
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(number):
                fn()
            best = min(best, (time.perf_counter() - start) / number)
    finally:
        if collecting:
            gc.enable()
    return best


def run(quick: bool) -> Result:
    res = Result(NAME)
    budget_s = 0.06 if quick else 0.8
    rows: dict[str, dict[int, float]] = {"core": {}, "state": {}}
    counts: dict[int, int] = {}
    for size in SIZES:
        messages = history(size)
        counts[size] = len(messages)
        rows["core"][size] = best_time_s(per_turn_fn(messages), budget_s)
        rows["state"][size] = best_time_s(state_roundtrip_fn(messages), budget_s)
    res.raw = {"messages": counts, "seconds": rows}
    for size in (10, 100, 1000):
        n = counts[size]
        core, state = rows["core"][size], rows["state"][size]
        res.add(
            f"sanitize + build_request, {n} msgs",
            core * 1e3,
            "ms/turn",
            f"{core / n * 1e6:.0f} us/msg; state JSON load+save {state * 1e3:.2f} ms",
        )
    ratios = {
        key: (rows[key][1000] / counts[1000]) / (rows[key][100] / counts[100])
        for key in ("core", "state")
    }
    res.add(
        "linearity: us/msg at 1001 / at 101",
        ratios["core"],
        "x",
        f"state JSON (context, not the check) {ratios['state']:.2f}x; 1.0 = linear",
        "linear" if ratios["core"] < 1.5 else "SUPERLINEAR",
    )
    return res
