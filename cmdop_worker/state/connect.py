"""How every process reaches Redis, and the one clock the stored state is written in.

`redis_client` builds the clients for state and events (fail-fast ones that retry
through a Redis restart, and blocking ones for XREAD BLOCK and pub/sub); `now_ms` is
the wall clock in milliseconds that deadlines, leases and event timestamps use.

Only the state layer imports `redis` (`pyproject.toml`'s contract): the other wings
name the client type and the errors they catch through this module.

One clock: every process reads `now_ms` (the host's wall clock, kept in step by NTP
on a fleet), and passes it into the scripts that need a time, because the deadlines
those scripts store are compared by the watchdog, in another process, against the
same clock. The parked calls' scripts and the fleet's rate limiter are the exception,
and read Redis's own `TIME`: their callers include machines and clients, whose
clocks the control plane does not trust (`approvals`), and the limiter must be one
decision for every coordinator whatever their clocks say.
"""

from __future__ import annotations

import time

import redis
from redis import ConnectionError as RedisConnectionError
from redis import Redis as Redis
from redis import RedisError as RedisError
from redis import ResponseError as RedisResponseError
from redis import TimeoutError as RedisTimeoutError

__all__ = [
    "Redis",
    "RedisConnectionError",
    "RedisError",
    "RedisResponseError",
    "RedisTimeoutError",
    "now_ms",
    "redis_client",
]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def redis_client(url: str, *, blocking: bool = False, name: str = "cmdop") -> redis.Redis:
    """A client for state and events. `blocking` clients wait as long as a read needs
    (XREAD BLOCK, pub/sub); others fail fast and retry through a Redis restart. `name`
    is its connections' name in `CLIENT LIST` (and MONITOR's attribution, `bench.redis`):
    `cmdop-coordinator` and `cmdop-machine` for workers, `cmdop` for clients."""
    return redis.Redis.from_url(
        url,
        client_name=name,
        decode_responses=True,
        socket_timeout=None if blocking else 10,
        socket_connect_timeout=5,
        health_check_interval=15,
        retry_on_timeout=True,
    )
