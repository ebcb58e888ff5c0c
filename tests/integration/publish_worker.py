"""A Celery worker of its own for `test_publish`: the fleet's configuration, and one task
that stores what each message brought (its id, arguments and headers) in a Redis list.

Started as `celery -A tests.integration.publish_worker worker` with `CMDOP_REDIS_URL`
set; never imported by the test process (it would read the environment at import).
"""

from __future__ import annotations

import json
from typing import Any

import redis
from celery import Celery

from cmdop_worker.celery_app import celery_config
from cmdop_worker.config import Settings

settings = Settings.from_env()
app = Celery("publish-test")
app.conf.update(celery_config(settings))
store = redis.Redis.from_url(settings.redis_url)


@app.task(name="test.echo", bind=True, ignore_result=True)
def echo(self: Any, key: str, n: int) -> None:
    headers = self.request.headers or {}
    seen = {"id": self.request.id, "n": n, "traceparent": headers.get("traceparent")}
    store.rpush(key, json.dumps(seen))
