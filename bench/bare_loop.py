"""The bound for `throughput`: the fleet's task graph on bare Celery, no agent around it.

A bare run is a fleet run as Celery sees it, every task a no-op but for handing on:

    client -> bare.run  (coordinator queue)  publishes turn 1, stores its result
              bare.turn (coordinator queue)  turn t <= turns: sets a counter to `tools`
                                             and publishes the turn's `bare.tool` tasks,
                                             round-robin over the machine queues,
                                             through one producer; turn turns+1 (the
                                             answer) pushes "<run> <wall ns>", the end
              bare.tool (machine queue)      DECR the counter; the one that reaches 0
                                             publishes the next turn

so 1 + (turns + 1) + turns x tools tasks a run, each published from where the fleet
publishes it (the client, the coordinator's turn, the machine worker that ends a turn),
with the fleet's Celery configuration (`celery_config`: acks_late, prefetch 1, JSON,
results of `run` only), on the same Redis, to the same number of queues and workers,
with the fleet's pool, concurrency and flags (`bench.bare`), on stock kombu.

Why it is a bound: a fleet run moves exactly these tasks the same way and does more
besides (the model call, state, events, the barrier's script, the permission gate);
on the same cores, it cannot go faster than Celery moves its messages, unless it
publishes them in fewer round trips than one each.

Workers load this module with `-A bench.bare_loop`; the URL comes from
`BENCH_BARE_LOOP_URL`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench.bare import bare_env, bare_worker, celery_config, kombu_as, stock_kombu_if_asked
from cmdop_worker.config import Settings
from cmdop_worker.surfaces.fleet import WorkerProcess

stock_kombu_if_asked()

COORDINATOR_QUEUE = "bare.coordinator"
DONE_KEY = "bare:loop:done"
_clients: dict[str, redis.Redis] = {}


def machine_queue(machine: str) -> str:
    return f"bare.machine.{machine}"


def make_app(url: str) -> Celery:
    celery = Celery("bare_loop")
    celery.conf.update(celery_config(Settings(redis_url=url)))
    celery.conf.task_default_queue = COORDINATOR_QUEUE

    def store() -> redis.Redis:
        return _clients.get(url) or _clients.setdefault(url, redis.Redis.from_url(url))

    def next_turn(run: dict[str, Any], turn: int) -> None:
        celery.send_task("bare.turn", args=[run, turn], queue=COORDINATOR_QUEUE)

    @celery.task(name="bare.run", shared=False)
    def start(run: dict[str, Any]) -> str:
        next_turn(run, 1)
        return str(run["id"])

    @celery.task(name="bare.turn", ignore_result=True, shared=False)
    def turn(run: dict[str, Any], n: int) -> None:
        if n > run["turns"]:
            store().rpush(DONE_KEY, f"{run['id']} {time.time_ns()}")
            return
        store().set(f"bare:loop:{run['id']}:{n}", run["tools"], ex=3600)
        machines, offset = run["machines"], run["offset"]
        with celery.producer_or_acquire() as producer:
            for c in range(run["tools"]):
                machine = machines[(offset + (n - 1) * run["tools"] + c) % len(machines)]
                queue = machine_queue(machine)
                tool.apply_async(args=[run, n], queue=queue, producer=producer)

    @celery.task(name="bare.tool", ignore_result=True, shared=False)
    def tool(run: dict[str, Any], n: int) -> None:
        if store().decr(f"bare:loop:{run['id']}:{n}") == 0:
            next_turn(run, n + 1)

    return celery


app = make_app(os.environ.get("BENCH_BARE_LOOP_URL", "redis://127.0.0.1:6379/0"))


class BareLoop:
    """Bare workers on a Redis the caller owns, laid out as a fleet, and batches of runs."""

    def __init__(self, url: str, concurrency: int, logdir: Path) -> None:
        self.url = url
        self.concurrency = concurrency
        self.logdir = logdir
        self.env = bare_env("BENCH_BARE_LOOP_URL", url, stock=True)
        self.workers: dict[str, WorkerProcess] = {}
        self.machines: list[str] = []
        self.app = make_app(url)
        self.redis = redis.Redis.from_url(url, decode_responses=True)
        self.count = 0

    def resize(self, coordinators: int, machines: list[str]) -> None:
        """One worker per machine queue and `coordinators` on the coordinator queue."""
        self.logdir.mkdir(parents=True, exist_ok=True)
        wanted = [f"bare-coordinator-{i}" for i in range(coordinators)]
        wanted += [f"bare-machine-{m}" for m in machines]
        for node in [n for n in self.workers if n not in wanted]:
            self.workers.pop(node).kill()
        for node in (n for n in wanted if n not in self.workers):
            machine = node.removeprefix("bare-machine-")
            queue = COORDINATOR_QUEUE if node.startswith("bare-coord") else machine_queue(machine)
            self.workers[node] = bare_worker(
                "bench.bare_loop", queue, node, self.concurrency, self.env, self.logdir
            )
        self.machines = list(machines)
        self._wait_ready(timeout_s=120)
        self.batch(len(machines), turns=1, tools=len(machines))  # every queue has served

    def _wait_ready(self, timeout_s: float) -> None:
        give_up = time.monotonic() + timeout_s
        for worker in self.workers.values():
            while b" ready." not in worker.log_path.read_bytes():
                if not worker.alive() or time.monotonic() > give_up:
                    raise RuntimeError(
                        f"bare worker {worker.name} not ready; see {worker.log_path}"
                    )
                time.sleep(0.05)

    def pids(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {"coordinator": [], "machine": []}
        for node, worker in self.workers.items():
            found["machine" if node.startswith("bare-machine") else "coordinator"].append(
                worker.pid
            )
        return found

    def batch(
        self, runs: int, *, turns: int, tools: int, timeout_s: float = 240
    ) -> dict[str, tuple[float, float]]:
        """Submit `runs` runs at once; each run's (submitted, ended) wall ms."""
        self.redis.delete(DONE_KEY)
        submitted: dict[str, float] = {}
        with kombu_as(stock=True):
            for i in range(runs):
                self.count += 1
                run: dict[str, Any] = {"id": f"r{self.count}", "turns": turns, "tools": tools}
                run.update(machines=self.machines, offset=i % len(self.machines))
                submitted[run["id"]] = time.time_ns() / 1e6
                self.app.send_task("bare.run", args=[run], queue=COORDINATOR_QUEUE)
        give_up = time.monotonic() + timeout_s
        while self.redis.llen(DONE_KEY) < runs:
            if time.monotonic() > give_up:
                raise RuntimeError(f"bare runs unfinished after {timeout_s} s")
            time.sleep(0.02)
        lines: list[str] = self.redis.lrange(DONE_KEY, 0, -1)  # type: ignore[assignment]
        ended = dict(line.split(" ", 1) for line in lines)
        return {r: (stamp, int(ended[r]) / 1e6) for r, stamp in submitted.items()}

    def close(self) -> None:
        for worker in self.workers.values():
            worker.kill()
        self.workers.clear()
        self.app.close()
        self.redis.close()
