"""How every process reaches Redis, and the one clock the stored state is written in.

`redis_client` builds the clients for state and events (fail-fast ones that retry
through a Redis restart, and blocking ones for XREAD BLOCK and pub/sub); `now_ms` is
the wall clock in milliseconds that deadlines, leases and event timestamps use.
"""

from __future__ import annotations

import time

import redis


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def redis_client(url: str, *, blocking: bool = False) -> redis.Redis:
    """A client for state and events. `blocking` clients wait as long as a read needs
    (XREAD BLOCK, pub/sub); others fail fast and retry through a Redis restart."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=None if blocking else 10,
        socket_connect_timeout=5,
        health_check_interval=15,
        retry_on_timeout=True,
    )
