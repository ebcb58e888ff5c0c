"""The baseline for turn overhead: a bare Celery chord, no agent loop around it.

8 no-op tasks over 2 queues (`bare.a`, `bare.b`, the machines' stand-ins) and a
callback on a third (`bare.cb`, the coordinator's). The app takes the fleet's own
Celery configuration (`celery_config`: acks_late, prefetch 1, JSON, events, the Redis
result backend), and its workers run with the fleet's flags: threads pool, the same
concurrency, `--without-mingle --without-gossip` (task events as the fleet's default:
off until a monitor asks). The callback stamps the wall
clock into a Redis list the benchmark pops, so a chord's time is "publish started ->
callback running", which is what a turn's fan-out and fan-in cost the fleet.

Stock or patched kombu, and the workers' flags: see `bench.bare` (stock by default;
`stock=False` runs kombu patched as the fleet does, to show what the patch is worth).

Workers load this module with `-A bench.bare_chord`; the URL comes from
`BENCH_BARE_REDIS_URL`, stock kombu from `BENCH_BARE_STOCK=1`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery, chord

from bench.bare import bare_env, bare_worker, kombu_as, stock_kombu_if_asked
from cmdop_worker.celery_app import celery_config
from cmdop_worker.config import Settings
from cmdop_worker.surfaces.fleet import RedisServer, WorkerProcess

stock_kombu_if_asked()

QUEUES = ("bare.a", "bare.b")
CALLBACK_QUEUE = "bare.cb"
_stamps: dict[str, redis.Redis] = {}


def make_app(url: str) -> Celery:
    celery = Celery("bare")
    celery.conf.update(celery_config(Settings(redis_url=url)))
    celery.conf.task_default_queue = CALLBACK_QUEUE

    @celery.task(name="bare.noop", shared=False)
    def noop(i: int) -> int:
        return i

    @celery.task(name="bare.done", ignore_result=True, shared=False)
    def done(results: list[Any], key: str) -> None:
        client = _stamps.get(url) or _stamps.setdefault(url, redis.Redis.from_url(url))
        client.rpush(key, time.time_ns())

    return celery


app = make_app(os.environ.get("BENCH_BARE_REDIS_URL", "redis://127.0.0.1:6379/0"))


class BareChord:
    """A private Redis, three bare workers, and a way to time one chord."""

    def __init__(self, concurrency: int, logdir: Path, *, stock: bool = True) -> None:
        self.concurrency = concurrency
        self.stock = stock
        self.logdir = logdir
        self.workers: list[WorkerProcess] = []
        self.count = 0

    def __enter__(self) -> BareChord:
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.server = RedisServer().start()
        env = bare_env("BENCH_BARE_REDIS_URL", self.server.url, self.stock)
        for queue in (*QUEUES, CALLBACK_QUEUE):
            worker = bare_worker(
                "bench.bare_chord", queue, queue, self.concurrency, env, self.logdir
            )
            self.workers.append(worker)
        self.app = make_app(self.server.url)
        # No socket timeout: BLPOP may wait longer than redis-py's default 5 s.
        self.redis = redis.Redis.from_url(self.server.url, socket_timeout=None)
        try:
            self.once(timeout_s=90)  # the workers are up when a chord completes
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for worker in self.workers:
            worker.kill()  # the Redis is thrown away: no need for a warm shutdown
        # A chord's AsyncResult unsubscribes from the result backend when collected,
        # maybe after this Redis is gone: forget the subscriptions now, so that is a
        # no-op rather than a reconnect error printed at exit.
        consumer = self.app.backend.result_consumer
        consumer.stop()
        consumer.subscribed_to.clear()
        self.app.close()
        self.redis.close()
        self.server.stop()

    def once(self, timeout_s: float = 30) -> tuple[float, float]:
        """One chord: (publish ms, publish start -> callback running ms)."""
        self.count += 1
        key = f"bare:done:{self.count}"
        header = [self.app.signature("bare.noop", args=(i,), queue=QUEUES[i % 2]) for i in range(8)]
        body = self.app.signature("bare.done", kwargs={"key": key}, queue=CALLBACK_QUEUE)
        with kombu_as(self.stock):
            started = time.time_ns()
            chord(header, body, app=self.app).apply_async()
            published = time.time_ns()
        popped = self.redis.blpop([key], timeout=timeout_s)
        if popped is None:
            raise RuntimeError(f"bare chord did not complete in {timeout_s} s")
        return (published - started) / 1e6, (int(popped[1]) - started) / 1e6
