"""The Python client: start runs, follow their events, wait, cancel, approve.

    client = Client.from_env()
    run = client.submit(prompt="check disk space", machine="web-1")
    for event in run.events():     # replays from the first event, then follows live
        ...
    result = run.wait(timeout=60)  # RunResult; raises RunFailed / RunCancelled / WaitTimeout
    run.cancel(ui=True)

Synchronous and thread-safe. Talks to the broker only to send `cmdop.run`; everything
else is read from and written to Redis directly, under the key schema in `keys`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from celery import Celery

from cmdop_worker.config import Settings
from cmdop_worker.errors import RunCancelled, RunFailed, RunNotFound, WaitTimeout
from cmdop_worker.events import follow_events
from cmdop_worker.keys import COORDINATOR_QUEUE, Keys
from cmdop_worker.models import CancelRequest, Event, MachinePresence, RunResult
from cmdop_worker.presence import online_machines
from cmdop_worker.runs import parse_request
from cmdop_worker.runtime import now_ms, redis_client
from cmdop_worker.store import RunStore


class Client:
    def __init__(self, settings: Settings, *, celery_app: Celery | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.redis = redis_client(settings.redis_url)
        self._blocking = redis_client(settings.redis_url, blocking=True)
        self.store = RunStore(self.redis, self.keys, ttl_s=settings.run_ttl_s)
        if celery_app is None:
            from cmdop_worker.celery_app import create_app

            celery_app = create_app(settings)
        self.celery = celery_app

    @classmethod
    def from_env(cls, **overrides: Any) -> Client:
        return cls(Settings.from_env(**overrides))

    def close(self) -> None:
        self.redis.close()
        self._blocking.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, request: dict[str, Any] | None = None, /, **fields: Any) -> Run:
        """Start a run; returns at once. Raises `InvalidRequest` before sending
        anything when the request does not validate."""
        payload = {**(request or {}), **fields}
        payload.setdefault("run_id", uuid.uuid4().hex)
        parsed = parse_request(payload)
        self.celery.send_task(
            "cmdop.run",
            kwargs={"request": parsed.model_dump(mode="json", exclude_none=True)},
            queue=COORDINATOR_QUEUE,
            task_id=f"{parsed.run_id}.start",
        )
        return Run(self, str(parsed.run_id))

    def run(self, run_id: str) -> Run:
        return Run(self, run_id)

    def cancel(self, run_id: str, *, ui: bool = False, reason: str = "user") -> bool:
        """Ask a run to stop. False when there is no such run or it has already ended."""
        cancel = CancelRequest(channel="ui" if ui else "operation", reason=reason)
        return self.store.request_cancel(run_id, cancel, now_ms=now_ms())

    def approve(self, run_id: str, tool_call_id: str, *, approve: bool = True) -> None:
        key = self.keys.approval(run_id, tool_call_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(key, "approve" if approve else "deny")
        pipe.expire(key, 300)
        pipe.execute()

    def machines(self) -> list[MachinePresence]:
        return online_machines(self.redis, self.keys)

    def result(self, run_id: str) -> RunResult | None:
        return self.store.load_result(run_id)

    def events(
        self, run_id: str, *, after_seq: int = 0, idle_timeout_s: float | None = None
    ) -> Iterator[Event]:
        return follow_events(
            self._blocking, self.keys, run_id, after_seq=after_seq, idle_limit_s=idle_timeout_s
        )


class Run:
    def __init__(self, client: Client, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def __repr__(self) -> str:
        return f"Run({self.run_id!r})"

    def events(self, *, after_seq: int = 0, idle_timeout_s: float | None = None) -> Iterator[Event]:
        """Every event from `after_seq` on, in order, ending after the terminal one."""
        return self.client.events(self.run_id, after_seq=after_seq, idle_timeout_s=idle_timeout_s)

    def result(self) -> RunResult | None:
        return self.client.result(self.run_id)

    def wait(self, timeout: float | None = None, *, raise_on_failure: bool = True) -> RunResult:
        give_up = None if timeout is None else time.monotonic() + timeout
        key = self.client.keys.terminal(self.run_id)
        while (result := self.result()) is None:
            if give_up is not None and time.monotonic() >= give_up:
                raise WaitTimeout(f"run {self.run_id} did not end within {timeout} s")
            if self.client.redis.exists(key) == 0:
                self._block_briefly(give_up)
            else:
                time.sleep(0.005)
        if raise_on_failure and result.status == "error":
            raise RunFailed(result)
        if raise_on_failure and result.status == "cancelled":
            raise RunCancelled(result)
        return result

    def _block_briefly(self, give_up: float | None) -> None:
        left_ms = 1000 if give_up is None else int(max(give_up - time.monotonic(), 0) * 1000)
        stream = self.client.keys.events(self.run_id)
        # Wake as soon as any new event lands, or after a short while at most.
        last = self.client.redis.xrevrange(stream, count=1)
        last_id = str(last[0][0]) if last else "0-0"
        self.client._blocking.xread({stream: last_id}, block=max(min(left_ms, 1000), 1), count=1)

    def cancel(self, *, ui: bool = False, reason: str = "user") -> bool:
        return self.client.cancel(self.run_id, ui=ui, reason=reason)

    def approve(self, tool_call_id: str, *, approve: bool = True) -> None:
        self.client.approve(self.run_id, tool_call_id, approve=approve)

    def exists(self) -> bool:
        if self.client.store.load(self.run_id) is None and self.result() is None:
            raise RunNotFound(f"no run {self.run_id}")
        return True
