"""What the bare-Celery baselines (`bare_chord`, `bare_loop`) share: kombu as released,
and workers started with the fleet's own flags.

Importing the fleet's configuration (`cmdop_worker.celery_app`) also installs its patch
to kombu's Redis channel (one client per channel instead of one per publish or ack),
which makes every Celery task cheaper. A bare baseline is stock Celery, so by default
its workers and its publishing run kombu as released (`BENCH_BARE_STOCK=1` in a
worker's environment, `kombu_as(stock=True)` around a publish); with `stock=False`
they run it patched as the fleet does.

A bare worker runs as the fleet's do (`cmdop-worker worker`): threads pool, the given
concurrency, `--without-mingle --without-gossip`, task events off until a monitor asks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kombu.transport import redis as kombu_redis

# Imported first: it installs the fleet's patch, which `_PATCHED` must be.
from cmdop_worker.celery_app import celery_config
from cmdop_worker.surfaces.fleet import WorkerProcess

__all__ = ["bare_env", "bare_worker", "celery_config", "kombu_as", "stock_kombu_if_asked"]

_PATCHED = kombu_redis.Channel.conn_or_acquire
_STOCK = getattr(_PATCHED, "cmdop_original", _PATCHED)
REPO_ROOT = str(Path(__file__).resolve().parent.parent)


@contextmanager
def kombu_as(stock: bool) -> Iterator[None]:
    """kombu's Redis channel as released (stock) or as the fleet patches it."""
    kombu_redis.Channel.conn_or_acquire = _STOCK if stock else _PATCHED  # type: ignore[method-assign]
    try:
        yield
    finally:
        kombu_redis.Channel.conn_or_acquire = _PATCHED  # type: ignore[method-assign]


def stock_kombu_if_asked() -> None:
    """In a bare worker: run kombu as released when its environment says so."""
    if os.environ.get("BENCH_BARE_STOCK") == "1":
        kombu_redis.Channel.conn_or_acquire = _STOCK  # type: ignore[method-assign]


def bare_env(url_var: str, url: str, stock: bool) -> dict[str, str]:
    """A bare worker's environment: the broker URL under `url_var`, kombu's flavour."""
    env = {**os.environ, url_var: url, "BENCH_BARE_STOCK": "1" if stock else "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


def bare_worker(
    module: str, queue: str, node: str, concurrency: int, env: dict[str, str], logdir: Path
) -> WorkerProcess:
    """A started worker of app `module` on `queue`, with the fleet's flags."""
    argv = [sys.executable, "-m", "celery", "-A", module, "worker", "-Q", queue]
    argv += ["-n", f"{node}@%h", "-P", "threads", "-c", str(concurrency), "-l", "INFO"]
    argv += ["--without-mingle", "--without-gossip"]
    return WorkerProcess(node, argv, env, logdir / f"{node}.log").start()
