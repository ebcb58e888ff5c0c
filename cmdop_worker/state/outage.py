"""One warning per Redis outage in a process, not one per retry.

The threads that keep a worker going retry Redis on their own clocks while it is away:
the watchdog every `watchdog_interval_s` (200 ms by default), the presence heartbeat,
the lease renewer per held turn, the cancel hub, a machine recording an outcome. Each
used to log every failed try, a hundred lines in a few seconds. Now each reports to
the process's one `OUTAGE`: the first failure logs one warning naming what failed and
why, later ones log at debug, and the first success after it logs one line saying how
long Redis was away. `cmdop_redis_reachable` (0 or 1) and `cmdop_redis_outages_total`
tell the same to Prometheus (`metrics`).

A thread reports `failed(where, exc)` when a Redis call of its loop raised, and
`reached()` when one went through; `reached` costs a lock-free read when nothing was
down, so the hot paths call it freely.
"""

from __future__ import annotations

import logging
import threading
import time

from cmdop_worker import metrics

log = logging.getLogger(__name__)


class Outage:
    """Whether this process currently finds Redis away, and since when."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic; None while Redis answers
        self._failures = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, where: str, exc: BaseException) -> None:
        """A Redis call of `where` failed: the first failure of an outage is a warning."""
        with self._lock:
            self._failures += 1
            if self._since is not None:
                log.debug("%s: Redis still unreachable (%s)", where, exc)
                return
            self._since = time.monotonic()
            self._failures = 1
        metrics.REDIS_REACHABLE.set(0)
        metrics.REDIS_OUTAGES.inc()
        log.warning("Redis unreachable (%s: %s); retrying quietly until it answers", where, exc)

    def reached(self) -> None:
        """A Redis call went through: an outage, if one was on, is over."""
        if self._since is None:
            return
        with self._lock:
            if self._since is None:
                return
            away_s, failures = time.monotonic() - self._since, self._failures
            self._since = None
        metrics.REDIS_REACHABLE.set(1)
        log.info("Redis reachable again after %.1fs (%d failed tries)", away_s, failures)


OUTAGE = Outage()
metrics.REDIS_REACHABLE.set(1)
