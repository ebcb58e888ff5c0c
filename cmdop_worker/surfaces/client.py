"""The Python client: start runs, follow their events, wait, cancel, approve.

    client = Client.from_env()
    run = client.submit(prompt="check disk space", machine="web-1")
    for event in run.events():     # replays from the first event, then follows live
        ...
    result = run.wait(timeout=60)  # RunResult; raises RunFailed / RunCancelled / WaitTimeout
    run.cancel(ui=True)

    report = client.submit(prompt="...", output_type=Report).output(timeout=60)  # a Report

Synchronous and thread-safe (`aio.AsyncClient` wraps it for asyncio). Talks to the broker
only to send `cmdop.run` and read that task's state (a refused request); everything
else is read from and written to Redis directly, under the key schema in `keys`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar, overload

from celery import Celery
from pydantic import BaseModel

from cmdop_worker.config import Settings
from cmdop_worker.core.event_data import ApprovalRequestData
from cmdop_worker.core.intake import parse_request
from cmdop_worker.core.selectors import Selector, selected
from cmdop_worker.errors import (
    DuplicateRun,
    InvalidRequest,
    RunCancelled,
    RunFailed,
    RunNotFound,
    ThreadBusy,
    WaitTimeout,
)
from cmdop_worker.messages import run_message, send
from cmdop_worker.models import (
    ApprovalVerdict,
    CancelRequest,
    Event,
    MachinePresence,
    RunResult,
)
from cmdop_worker.state import starts
from cmdop_worker.state.approvals import Approvals
from cmdop_worker.state.connect import RedisResponseError, now_ms, redis_client
from cmdop_worker.state.events import EventSink, follow_events, read_events
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.presence import online_machines
from cmdop_worker.state.seen import submit_warnings
from cmdop_worker.state.store import RunStore
from cmdop_worker.state.threads import ThreadInfo, ThreadStore
from cmdop_worker.surfaces.answer import answer_parked
from cmdop_worker.surfaces.request_shapes import output_schema_of, request_repr

__all__ = ["Client", "Run", "output_schema_of", "request_repr"]

OutputT = TypeVar("OutputT")
ModelT = TypeVar("ModelT", bound=BaseModel)


class Client:
    def __init__(self, settings: Settings, *, celery_app: Celery | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.redis = redis_client(settings.redis_url)
        self._blocking = redis_client(settings.redis_url, blocking=True)
        self.store = RunStore(self.redis, self.keys, ttl_s=settings.run_ttl_s)
        self.thread_store = ThreadStore(self.redis, self.keys, ttl_s=settings.thread_ttl_s)
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

    @overload
    def submit(
        self, request: dict[str, Any] | None = None, /, *, output_type: type[ModelT], **fields: Any
    ) -> Run[ModelT]: ...

    @overload
    def submit(
        self, request: dict[str, Any] | None = None, /, *, output_type: None = None, **fields: Any
    ) -> Run[Any]: ...

    def submit(
        self,
        request: dict[str, Any] | None = None,
        /,
        *,
        output_type: type[BaseModel] | None = None,
        **fields: Any,
    ) -> Run[Any]:
        """Start a run; returns at once. Raises `InvalidRequest` (a `machine` never seen
        too) or `DuplicateRun` before sending anything; `Run.warnings` says what it was
        accepted despite. With `output_type`, `Run.output()` returns an instance of it."""
        payload = {**(request or {}), **fields}
        if output_type is not None:
            payload["output_schema"] = output_schema_of(output_type)
        payload.setdefault("run_id", uuid.uuid4().hex)
        parsed = parse_request(payload)
        run_id = str(parsed.run_id)
        if self.redis.exists(self.keys.state(run_id)):
            raise DuplicateRun(f"run_id: a run with id '{run_id}' already exists")
        warnings = submit_warnings(self.redis, self.keys, parsed.machine)
        body = parsed.model_dump(mode="json", exclude_none=True)
        # Before the send: a coordinator killed as it takes the message could lose it.
        sent = now_ms()
        with starts.expected(self.redis, self.keys, body, now_ms=sent):
            send(run_message(body, shown=request_repr(parsed), sent_ms=sent), via=self.celery)
        return Run(self, run_id, output_type, submitted=True, warnings=warnings)

    def run(self, run_id: str) -> Run[Any]:
        return Run(self, run_id)

    def cancel(
        self, run_id: str, *, ui: bool = False, reason: str = "user", submitted: bool = False
    ) -> bool:
        """Ask a run to stop. False when there is no such run or it has already ended.

        A ui request is never downgraded: an operation request after it changes nothing
        (and still returns True: the run is being cancelled). `submitted=True` says the
        caller sent this run's `cmdop.run` itself (`Run.cancel` of a run from `submit`
        passes it): the request is then kept even though no coordinator has stored the
        run yet, and the run ends CANCELLED, calling no model, as soon as it starts."""
        cancel = CancelRequest(channel="ui" if ui else "operation", reason=reason)
        return self.store.request_cancel(run_id, cancel, now_ms=now_ms(), before_start=submitted)

    def approve(
        self,
        run_id: str,
        tool_call_id: str,
        *,
        approve: bool = True,
        input: dict[str, Any] | None = None,
        reason: str | None = None,
        by: str | None = None,
        shown: Mapping[str, Any] | None = None,
    ) -> ApprovalRequestData:
        """Answer a parked tool call; returns the request answered. `input` runs the call
        with edited arguments; `reason` (a denial's) reaches the model; `by` defaults to
        the OS user; `shown`, the APPROVAL_REQUEST's data the person saw, is checked
        against the call's record. Raises `RunNotFound`, `InvalidRequest` (a bad
        `input`), or `ApprovalNotPending` (unknown call, already answered, expired,
        cancelled or ended, or "changed": not what was shown), having answered
        nothing."""
        if not self.run(run_id).exists():
            raise RunNotFound(f"no run {run_id} (unknown, or expired)")
        ttl_s, maxlen = self.settings.run_ttl_s, self.settings.event_stream_maxlen
        events = EventSink(self.redis, self.keys, maxlen=maxlen, ttl_s=ttl_s, clock_ms=now_ms)
        approvals = Approvals(self.redis, self.keys, events, ttl_s=ttl_s)
        verdict: ApprovalVerdict = "approved" if approve else "denied"
        return answer_parked(
            approvals,
            self.store,
            self.celery,
            run_id,
            tool_call_id,
            verdict,
            input,
            reason,
            by,
            shown,
        )

    def threads(self) -> list[ThreadInfo]:
        """Every live thread, most recently used first."""
        return self.thread_store.all(now_ms=now_ms())

    def thread(self, thread_id: str) -> ThreadInfo | None:
        """A thread's runs, oldest first, and what it is busy with; None if unknown."""
        return self.thread_store.info(thread_id)

    def delete_thread(self, thread_id: str) -> bool:
        """Forget a thread's history and runs list; False when there was no such thread."""
        return self.thread_store.delete(thread_id)

    def machines(self, selector: str | Selector | None = None) -> list[MachinePresence]:
        """The machines online (those `selector` matches), by name; or SelectorError."""
        return selected(online_machines(self.redis, self.keys), selector)

    def coordinators_online(self) -> int:
        """How many coordinators have a live presence key (their watchdog writes it)."""
        return sum(1 for _ in self.redis.scan_iter(match=self.keys.coordinator_pattern))

    def events_so_far(self, run_id: str) -> list[Event]:
        """The events already written for a run, oldest first, without waiting."""
        events: list[Event] = []
        after_id = "-"
        while rows := read_events(self.redis, self.keys, run_id, after_id=after_id):
            events.extend(event for _, event in rows)
            after_id = rows[-1][0]
        return events

    def result(self, run_id: str) -> RunResult | None:
        return self.store.load_result(run_id)

    def events(
        self, run_id: str, *, after_seq: int = 0, idle_timeout_s: float | None = None
    ) -> Iterator[Event]:
        return follow_events(
            self._blocking, self.keys, run_id, after_seq=after_seq, idle_limit_s=idle_timeout_s
        )


class Run(Generic[OutputT]):
    def __init__(
        self,
        client: Client,
        run_id: str,
        output_type: type[OutputT] | None = None,
        *,
        submitted: bool = False,
        warnings: tuple[str, ...] = (),
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.output_type = output_type
        self.submitted = submitted  # sent by this client: it may be cancelled before it starts
        self.warnings = warnings  # what submit noticed, such as its machine being offline
        self._started = False
        self.steered_from: str | None = None  # the request's own id, when it steered this run
        self._after_seq = 0

    def __repr__(self) -> str:
        return f"Run({self.run_id!r})"

    def events(self, *, after_seq: int = 0, idle_timeout_s: float | None = None) -> Iterator[Event]:
        """Every event from `after_seq` on, in order, ending after the terminal one.
        Raises `InvalidRequest` when the fleet refused to start the run."""
        if not self._await_first_event(idle_timeout_s):
            return
        after_seq = max(after_seq, self._after_seq)
        yield from self.client.events(
            self.run_id, after_seq=after_seq, idle_timeout_s=idle_timeout_s
        )

    def result(self) -> RunResult | None:
        return self.client.result(self.run_id)

    def wait(self, timeout: float | None = None, *, raise_on_failure: bool = True) -> RunResult:
        """The result once the run ended. Raises `InvalidRequest` (the fleet refused it),
        `WaitTimeout`, and unless told not to, `RunFailed` or `RunCancelled`."""
        give_up = None if timeout is None else time.monotonic() + timeout
        ended = False
        while (result := self.result()) is None:
            self.raise_if_refused()
            if give_up is not None and time.monotonic() >= give_up:
                raise WaitTimeout(f"run {self.run_id} did not end within {timeout} s")
            if ended:
                time.sleep(0.005)  # ended, yet no result: the ending is being written
            ended = self._await_terminal(give_up)
        if raise_on_failure and result.status == "error":
            raise RunFailed(result)
        if raise_on_failure and result.status == "cancelled":
            raise RunCancelled(result)
        return result

    def output(self, timeout: float | None = None) -> OutputT:
        """The run's structured output: an `output_type` instance when one was given."""
        value = self.wait(timeout).output
        if self.output_type is None:
            return value  # type: ignore[no-any-return]
        return self.output_type.model_validate(value)  # type: ignore[attr-defined,no-any-return]

    def raise_if_refused(self) -> None:
        """`InvalidRequest` with the fleet's message if `cmdop.run` (`<run_id>.start`) failed;
        a refusal as a duplicate id is the other submission's failure, not this run's."""
        if self._started:
            return
        start = self.client.celery.AsyncResult(f"{self.run_id}.start")
        if start.state == "SUCCESS":
            self._started = True
            if isinstance(start.result, str) and start.result != self.run_id:
                self._follow_steered(start.result)
        elif start.state == "FAILURE":
            refused = _refusal(start)
            if refused == "ThreadBusy":
                raise ThreadBusy(str(start.result))
            if refused != "DuplicateRun":
                raise InvalidRequest(str(start.result))

    def _follow_steered(self, run_id: str) -> None:
        """The request steered `run_id` (on_busy=steer on a busy thread): this `Run` is
        that run from now on, followed from its next event."""
        self.steered_from, self.run_id = self.run_id, run_id
        self._after_seq = int(self.client.redis.get(self.client.keys.seq(run_id)) or 0)

    def _await_first_event(self, idle_timeout_s: float | None) -> bool:
        stream = self.client.keys.events(self.run_id)
        give_up = None if idle_timeout_s is None else time.monotonic() + idle_timeout_s
        while not self.client.redis.exists(stream):
            self.raise_if_refused()
            if self._started:
                return True
            if give_up is not None and time.monotonic() >= give_up:
                return False
            self.client._blocking.xread({stream: "0-0"}, block=250, count=1)
        return True

    def _await_terminal(self, give_up: float | None) -> bool:
        """Block until the run's terminal event is written, for a second at most (the
        caller checks for a refused start in between); True when it has been. The
        terminal marker is a one-element list: rotating it onto itself wakes every
        waiter once, at the end, whatever the run emits meanwhile."""
        left_s = 1.0 if give_up is None else max(give_up - time.monotonic(), 0.0)
        marker = self.client.keys.terminal(self.run_id)
        block_s = max(min(left_s, 1.0), 0.01)  # Redis takes fractional seconds
        try:
            moved = self.client._blocking.blmove(marker, marker, block_s, "LEFT", "LEFT")  # type: ignore[arg-type]
        except RedisResponseError:
            # BLMOVE (a write) refused: a read-only replica or user. Wait for any new
            # event instead, read-only.
            stream = self.client.keys.events(self.run_id)
            self.client._blocking.xread({stream: "$"}, block=int(block_s * 1000), count=1)
            return bool(self.client.redis.exists(marker))
        return moved is not None

    def cancel(self, *, ui: bool = False, reason: str = "user") -> bool:
        """`Client.cancel`; a run this client submitted is cancelled even while its
        `cmdop.run` is still queued."""
        return self.client.cancel(self.run_id, ui=ui, reason=reason, submitted=self.submitted)

    def approve(
        self, tool_call_id: str, *, approve: bool = True, **answer: Any
    ) -> ApprovalRequestData:
        """`Client.approve` for this run: `input=`, `reason=`, `by=` as there."""
        return self.client.approve(self.run_id, tool_call_id, approve=approve, **answer)

    def exists(self) -> bool:
        """Whether the fleet holds the run: its record or its result (False: never
        started, not yet stored, or expired)."""
        keys = self.client.keys
        return bool(self.client.redis.exists(keys.state(self.run_id), keys.result(self.run_id)))

    def started_ms(self) -> int | None:
        """When a coordinator started the run (wall clock, ms); None if it has no record."""
        state = self.client.store.load(self.run_id)
        return None if state is None else state.started_ms

    def wait_started(self, timeout_s: float) -> bool:
        """Whether a coordinator has taken the run (stored its record) within `timeout_s`.
        Raises `InvalidRequest` when the fleet refused it."""
        keys = self.client.keys
        give_up = time.monotonic() + timeout_s
        while not self.client.redis.exists(keys.state(self.run_id), keys.result(self.run_id)):
            self.raise_if_refused()
            if time.monotonic() >= give_up:
                return False
            time.sleep(0.05)
        return True


def _refusal(start: Any) -> str:
    """The error class a failed `cmdop.run` raised, by name: from the rebuilt exception,
    or failing that from the last line of its stored traceback."""
    name = type(start.result).__name__
    if name in ("ThreadBusy", "DuplicateRun"):
        return name
    last = (start.traceback or "").strip().splitlines()[-1:] or [""]
    return last[0].split(":", 1)[0].rsplit(".", 1)[-1] or name
