"""Prometheus metrics for what Flower cannot tell: turns, model calls, tools, retries,
cancels and how runs end.

Flower's `/metrics` already counts Celery tasks by name and state; these are the loop's
own measures. Each worker process serves them on `CMDOP_METRICS_PORT` when it is set
(0, the default, serves nothing; several workers on one host need one port each).
Recorded by the turn task, the model sink, the rate limiter, the machine worker and
`finish`.
"""

from __future__ import annotations

import functools
import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

TURN_SECONDS = Histogram(
    "cmdop_turn_seconds", "Time a coordinator spent executing one turn.", buckets=_SECONDS
)
MODEL_CALL_SECONDS = Histogram(
    "cmdop_model_call_seconds",
    "One turn's model call, retries included.",
    ["outcome"],
    buckets=_SECONDS,
)
MODEL_RETRIES = Counter("cmdop_model_retries_total", "Model call retries, by cause.", ["cause"])
MODEL_RATE_LIMITED = Counter(
    "cmdop_model_rate_limited_total",
    "Responses that paused a model for the whole fleet (429, 529), by status.",
    ["status"],
)
RATE_LIMIT_WAIT_SECONDS = Histogram(
    "cmdop_rate_limit_wait_seconds",
    "Time a model call waited for the fleet's rate limiter before an attempt.",
    buckets=_SECONDS,
)
TOOL_SECONDS = Histogram(
    "cmdop_tool_seconds",
    "A tool call on its machine, by tool and outcome status.",
    ["tool", "status"],
    buckets=_SECONDS,
)
RUNS_ENDED = Counter(
    "cmdop_runs_ended_total", "Runs ended, by status and stop reason.", ["status", "stop_reason"]
)
CANCELS = Counter("cmdop_cancels_total", "Runs ended by a cancel, by channel.", ["channel"])
REDIS_REACHABLE = Gauge(
    "cmdop_redis_reachable", "1 while this process reaches Redis, 0 during an outage."
)
REDIS_OUTAGES = Counter("cmdop_redis_outages_total", "Outages of Redis this process saw begin.")


@functools.lru_cache(maxsize=1024)
def tool_seconds(tool: str, status: str) -> Histogram:
    """`TOOL_SECONDS` for one tool and status: the same child `labels` returns, found
    once instead of on every call (`labels` takes a lock and builds its key each time)."""
    return TOOL_SECONDS.labels(tool=tool, status=status)


def serve(port: int, addr: str = "127.0.0.1") -> bool:
    """Serve this process's metrics on `port`; False (logged) when it cannot."""
    if port <= 0:
        return False
    try:
        start_http_server(port, addr=addr)
    except OSError as exc:
        log.warning("metrics not served on port %s: %s", port, exc)
        return False
    log.info("metrics on http://127.0.0.1:%s/metrics", port)
    return True
