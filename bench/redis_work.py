"""Redis work per model turn and per tool call, by command and by caller, and Redis CPU.

A private stack (Redis, the fake model, a coordinator, machines `alpha` and `beta`)
runs RUNS runs of the shape the figures in the README are quoted for: turn 1 asks for
4 `bench_noop` calls spread over the two machines, turn 2 answers. MONITOR counts every
command the server runs while they do, split by who sent it:

- `celery/kombu`: the connections Celery opens in the workers, its broker transport and
  result backend (unnamed);
- `coordinator` and `machine`: the workers' own state connections (`cmdop-coordinator`,
  `cmdop-machine`, `state.connect.redis_client`), what they send themselves;
- `scripts`: what runs inside their Lua scripts (one EVALSHA sent, many commands run);
- `client`: the submitting and following `Client` (`cmdop`).

The fleet's idle background (heartbeats, the watchdog's sweeps, kombu's polling) is
counted over a quiet window of the same length first and subtracted, caller by
caller. `INFO commandstats` totals are printed beside MONITOR's as a check, and Redis
CPU (`used_cpu_user` + `used_cpu_sys`) per run. `python -m bench --only redis`.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Any

import redis

from bench.common import Result, Stack, text, tool_use

NAME = "redis"
RUNS = 5
CALLS = 4
TURNS = 2  # model turns per run
CALLERS = {"cmdop-coordinator": "coordinator", "cmdop-machine": "machine", "cmdop": "client"}


def run(quick: bool = False) -> Result:
    result = Result(NAME)
    runs = 2 if quick else RUNS
    with Stack() as stack:
        url = stack.redis.url
        admin = redis.Redis.from_url(url, decode_responses=True, client_name="bench-admin")
        prompts = [
            stack.script(
                [
                    [
                        tool_use("bench_noop", machine=("alpha", "beta")[i % 2])
                        for i in range(CALLS)
                    ],
                    text("done"),
                ]
            )
            for _ in range(runs)
        ]
        # One warm run: scripts loaded, connections open, presence read once.
        stack.client.submit(
            prompt=stack.script([[tool_use("bench_noop", machine="alpha")], text("ok")])
        )
        time.sleep(2)

        started = time.monotonic()
        busy, cpu_s = _count(admin, url, lambda: _runs(stack, prompts))
        busy_s = time.monotonic() - started
        idle, _ = _count(admin, url, lambda: time.sleep(busy_s))  # as long, and quiet
        admin.close()

    work = {caller: busy[caller] - idle.get(caller, collections.Counter()) for caller in busy}
    totals = collections.Counter[str]()
    for counted in work.values():
        totals.update({k: v for k, v in counted.items() if v > 0})
    turns, calls = runs * TURNS, runs * CALLS
    total = sum(totals.values())
    result.add(
        "commands per run", total / runs, "cmds", f"{runs} runs, {TURNS} turns, {CALLS} calls"
    )
    result.add("commands per model turn", total / turns, "cmds")
    result.add("commands per tool call", total / calls, "cmds", "all of a run's over its calls")
    for caller, counted in sorted(work.items()):
        result.add(f"  by {caller}", sum(v for v in counted.values() if v > 0) / turns, "cmds/turn")
    for name, count in totals.most_common(10):
        result.add(f"  {name}", count / turns, "cmds/turn")
    result.add("Redis CPU per run", cpu_s / runs * 1000, "ms")
    result.raw = {
        "runs": runs,
        "by_caller": {c: dict(v) for c, v in work.items()},
        "idle": {c: dict(v) for c, v in idle.items()},
        "cpu_s": cpu_s,
    }
    return result


def _runs(stack: Stack, prompts: list[str]) -> None:
    for prompt in prompts:
        stack.client.submit(prompt=prompt).wait(timeout=120)


def _count(
    admin: redis.Redis, url: str, during: Any
) -> tuple[dict[str, collections.Counter[str]], float]:
    """Commands run while `during()` runs, by caller and name; and Redis CPU seconds."""
    counted: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    stop = f"bench-stop-{uuid.uuid4().hex}"  # the last command it reads: MONITOR lags
    ready = threading.Event()
    seen: list[tuple[str, str]] = []  # (client address or "lua", command name)

    def watch() -> None:
        client = redis.Redis.from_url(url, decode_responses=True, client_name="bench-monitor")
        with client.monitor() as monitor:
            ready.set()
            for event in monitor.listen():
                if stop in event["command"]:
                    return
                words = event["command"].split()
                name = words[0].strip('"').upper() if words else "?"
                where = "lua" if event.get("client_type") == "lua" else event["client_address"]
                where += "" if where == "lua" else f":{event['client_port']}"
                seen.append((where, name))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ready.wait(10)
    cpu_before = _cpu_s(admin)
    names = _names(admin)
    during()
    names.update(_names(admin))
    cpu_s = _cpu_s(admin) - cpu_before
    admin.echo(stop)
    watcher.join(60)
    for where, name in seen:
        caller = "scripts" if where == "lua" else _caller(names.get(where))
        if caller != "bench":
            counted[caller][name] += 1
    return counted, cpu_s


def _names(admin: redis.Redis) -> dict[str, str]:
    return {c["addr"]: c.get("name", "") for c in admin.client_list()}


def _caller(name: str | None) -> str:
    if name is None:
        return "closed before listed"
    if name.startswith("bench"):
        return "bench"
    return CALLERS.get(name, "celery/kombu" if name == "" else name)


def _cpu_s(admin: redis.Redis) -> float:
    cpu = admin.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
