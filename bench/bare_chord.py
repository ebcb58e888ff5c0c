"""The baseline for turn overhead: a bare Celery chord, no agent loop around it.

8 no-op tasks over 2 queues (`bare.a`, `bare.b`, the machines' stand-ins) and a
callback on a third (`bare.cb`, the coordinator's). The app takes the fleet's own
Celery configuration (`celery_config`: acks_late, prefetch 1, JSON, events, the Redis
result backend), and its workers run with the fleet's flags: threads pool, the same
concurrency, `--without-mingle --without-gossip` (task events as the fleet's default:
off until a monitor asks). The callback stamps the wall
clock into a Redis list the benchmark pops, so a chord's time is "publish started ->
callback running", which is what a turn's fan-out and fan-in cost the fleet.

Importing the fleet's configuration also installs its patch to kombu's Redis channel
(one client per channel instead of one per publish or ack; `cmdop_worker.celery_app`),
which makes every Celery task cheaper, the chord's too. A bare chord is stock Celery,
so by default (`stock=True`) its workers and its publishing run kombu as released; with
`stock=False` they run it patched as the fleet does, to show what the patch is worth.

Workers load this module with `-A bench.bare_chord`; the URL comes from
`BENCH_BARE_REDIS_URL`, stock kombu from `BENCH_BARE_STOCK=1`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from celery import Celery, chord
from kombu.transport import redis as kombu_redis

from cmdop_worker.celery_app import celery_config
from cmdop_worker.config import Settings
from cmdop_worker.surfaces.fleet import RedisServer, WorkerProcess

_PATCHED = kombu_redis.Channel.conn_or_acquire
_STOCK = getattr(_PATCHED, "cmdop_original", _PATCHED)


@contextmanager
def kombu_as(stock: bool) -> Iterator[None]:
    """kombu's Redis channel as released (stock) or as the fleet patches it."""
    kombu_redis.Channel.conn_or_acquire = _STOCK if stock else _PATCHED  # type: ignore[method-assign]
    try:
        yield
    finally:
        kombu_redis.Channel.conn_or_acquire = _PATCHED  # type: ignore[method-assign]


if os.environ.get("BENCH_BARE_STOCK") == "1":  # a worker of the stock chord
    kombu_redis.Channel.conn_or_acquire = _STOCK  # type: ignore[method-assign]

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
        env = {**os.environ, "BENCH_BARE_REDIS_URL": self.server.url}
        env["BENCH_BARE_STOCK"] = "1" if self.stock else "0"
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        for queue in (*QUEUES, CALLBACK_QUEUE):
            argv = [sys.executable, "-m", "celery", "-A", "bench.bare_chord", "worker"]
            argv += ["-Q", queue, "-n", f"{queue}@%h", "-P", "threads"]
            argv += ["-c", str(self.concurrency), "-l", "INFO"]
            argv += ["--without-mingle", "--without-gossip"]
            log = self.logdir / f"{queue}.log"
            self.workers.append(WorkerProcess(queue, argv, env, log).start())
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
