"""One warning per outage: the first failure warns, later ones are quiet, the return says so."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from cmdop_worker.state.outage import Outage


def _sample(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    assert value is not None, name
    return value


def test_an_outage_warns_once_and_its_end_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage()
    outages_before = _sample("cmdop_redis_outages_total")
    caplog.set_level(logging.DEBUG, logger="cmdop_worker.state.outage")

    outage.reached()  # nothing was down: nothing to say
    for n in range(50):
        outage.failed("watchdog" if n % 2 else "heartbeat", ConnectionError("refused"))
    assert outage.down and _sample("cmdop_redis_reachable") == 0
    outage.reached()
    outage.reached()

    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["Redis unreachable (heartbeat: refused); retrying quietly until it answers"]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and infos[0].startswith("Redis reachable again after")
    assert infos[0].endswith("(50 failed tries)")
    assert not outage.down and _sample("cmdop_redis_reachable") == 1
    assert _sample("cmdop_redis_outages_total") == outages_before + 1

    outage.failed("watchdog", ConnectionError("refused"))  # a second outage warns again
    assert sum(r.levelno >= logging.WARNING for r in caplog.records) == 2
