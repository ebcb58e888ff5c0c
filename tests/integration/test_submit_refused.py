"""A `Client.submit` whose send fails starts no run: the start it kept for the watchdog
(`state.starts`) goes with the failed send, so a caller that retries is not answered
with two runs."""

from __future__ import annotations

from typing import Any

import pytest
from kombu.exceptions import OperationalError

from cmdop_worker.config import Settings
from cmdop_worker.state.keys import start_member
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import RedisServer

pytestmark = pytest.mark.integration


class _BrokerDown:
    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        raise OperationalError("broker unreachable")


def test_a_submit_whose_send_failed_leaves_no_start_for_the_watchdog_to_send(
    redis_server: RedisServer,
) -> None:
    client = Client(
        Settings(redis_url=redis_server.url, key_prefix="submit-fail:"),
        celery_app=_BrokerDown(),  # type: ignore[arg-type]
    )
    try:
        with pytest.raises(OperationalError):
            client.submit(prompt="hello", run_id="r-send-failed")
        assert client.redis.get(client.keys.start("r-send-failed")) is None
        assert client.redis.zscore(client.keys.deadlines, start_member("r-send-failed")) is None
    finally:
        client.close()
