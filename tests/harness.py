"""An in-process coordinator: runs' turns taken in the test process, with no worker.

For tests of what the coordinator alone decides (requests built, model errors and
retries, fallbacks, cancels before a start, budgets, threads, coordinator tools): a
`TurnHarness` stands where the fleet's coordinator workers would, on the session's real
`redis-server` and the session's fake Anthropic server.

The `turn_harness` fixture (tests/conftest.py) is one harness for the session, as the
fleet has one coordinator; tests isolate themselves by run id and script name, as on
the fleet. Everything but the worker is the fleet's own. The harness has its own key prefix and
broker key prefix on the session Redis (`Settings.key_prefix`, `broker_key_prefix`),
so the session fleet's workers, if running, neither see its runs nor take its
messages. A Celery app made from its settings is the one `messages.send` and
`messages.publish` use while the harness lives, so every message a turn sends (turn
n+1, a coordinator tool, a start that waited for its thread) really goes to the
broker, under the harness's prefix. `drain` takes them from the two coordinator queues
one at a time, in order, and runs each through the fleet's own task body
(`cmdop_worker.tasks`) with the task id and headers it was sent with; `cmdop.run`'s
return value or refusal is stored in the result backend, as a worker stores it, so a
client learns of a refused start the usual way.

Draining is synchronous and happens when a test waits: the harness's client
(`HarnessClient`) drains before it reads a result or events, so `run.wait()` and
`run.events()` see the run as far as the coordinator can take it alone. No machine is
online under the harness's prefix, so its catalogue has the coordinator's tools only
and no call is ever sent to a machine: tests of machine tools use the fleet.
Nothing here runs in the background, so a test that needs to act while a run is in
flight (cancel a running tool, steer mid-turn) belongs on the fleet too, unless it
drives `drain(limit=...)` itself. No watchdog runs: a deadline, a lost lease or a lost
start is not acted on.
"""

from __future__ import annotations

import traceback
import uuid
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery
from kombu import Connection
from pydantic import SecretStr

from cmdop_worker import messages, runtime, tasks
from cmdop_worker.celery_app import create_app
from cmdop_worker.config import Settings
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import Event, RunResult
from cmdop_worker.runtime import Runtime
from cmdop_worker.state.keys import CONTINUATION_QUEUE, COORDINATOR_QUEUE
from cmdop_worker.surfaces.client import Client, Run

REPO = Path(__file__).resolve().parent.parent

# The session fleet's settings that a coordinator reads (tests/conftest.py, fleet_env).
FLEET_LIKE: dict[str, Any] = {
    "llm_backoff_base_s": 0.02,
    "llm_backoff_max_s": 0.2,
    "approval_timeout_s": 2,
    "tool_grace_ms": 1500,
    "agents_file": REPO / "config" / "agents.example.toml",
    "hide_map_file": REPO / "config" / "hide_map.example.toml",
}
# The fleet's own task bodies, by the name a message carries.
COORDINATOR_TASKS = {
    messages.RUN_TASK: tasks.run,
    messages.TURN_TASK: tasks.turn,
    messages.LOCAL_TOOL_TASK: tasks.local_tool,
    messages.HAND_ON_TASK: tasks.hand_on,
}
# What `cmdop.run` declares it throws (a refusal; `DuplicateRun`, `ThreadBusy` are kinds
# of it): stored as the task's failure, which the client reads.
REFUSALS = (InvalidRequest,)
# Far more than any test's run takes: a run that loops forever fails instead of hanging.
MAX_TASKS = 500


@dataclass(frozen=True)
class Taken:
    """A message the harness took off a queue."""

    queue: str
    task: str
    task_id: str
    args: list[Any]
    kwargs: dict[str, Any]
    headers: Mapping[str, Any] = field(default_factory=dict)


class TurnHarness:
    """A coordinator in this process (the module docstring). `settings` override the
    fleet-like defaults (`Settings` field names)."""

    def __init__(self, redis_url: str, model_url: str, **settings: Any) -> None:
        tag = f"h{uuid.uuid4().hex[:10]}"
        self.settings = Settings(
            redis_url=redis_url,
            key_prefix=f"{tag}:",
            broker_key_prefix=f"{tag}.",
            anthropic_base_url=model_url,
            anthropic_api_key=SecretStr("sk-test-secret-do-not-leak"),
            **{**FLEET_LIKE, **settings},
        )
        self.app: Celery = create_app(self.settings)
        self.rt = Runtime(self.settings)
        self.client = HarnessClient(self)
        self.taken: list[Taken] = []  # every coordinator message run, in order
        self._connection: Connection = self.app.connection_for_read()
        self._queues = {
            name: self._connection.SimpleQueue(self.app.amqp.queues[name], no_ack=True)
            for name in (COORDINATOR_QUEUE, CONTINUATION_QUEUE)
        }
        self._draining = False

    @property
    def env(self) -> dict[str, str]:
        """What a process of the fleet (the CLI, say) needs to reach this harness: its
        Redis, its key prefix and its broker's."""
        return {
            "CMDOP_REDIS_URL": self.settings.redis_url,
            "CMDOP_KEY_PREFIX": self.settings.key_prefix,
            "CMDOP_BROKER_KEY_PREFIX": self.settings.broker_key_prefix,
        }

    def close(self) -> None:
        for queue in self._queues.values():
            queue.close()
        self._connection.release()
        self.client.close()
        self.rt.close()
        self.app.close()

    def drain(self, *, limit: int = MAX_TASKS) -> int:
        """Run the coordinator's queued messages, and those they send, until none is
        left or `limit` have run; how many ran. Reentrant calls (a task body that reads
        through the harness's client) do nothing."""
        if self._draining:
            return 0
        self._draining = True
        try:
            ran = 0
            while ran < limit and (message := self._next()) is not None:
                self._run(message)
                ran += 1
            if ran == MAX_TASKS:
                raise AssertionError(f"the coordinator ran {ran} tasks without going idle")
            return ran
        finally:
            self._draining = False

    def _next(self) -> Taken | None:
        """The oldest message of the start queue, else of the continuation queue."""
        for name, queue in self._queues.items():
            try:
                message = queue.get(block=False)
            except queue.Empty:
                continue
            return _taken(name, message)
        return None

    def _run(self, message: Taken) -> None:
        """Run `message` through its task's body, as a coordinator worker would: in this
        harness's runtime, its sends on this harness's broker. A refused start is stored
        as the worker stores it; any other failure is the test's (raised)."""
        self.taken.append(message)
        task = COORDINATOR_TASKS[message.task]
        task.push_request(
            id=message.task_id,
            args=message.args,
            kwargs=message.kwargs,
            headers=dict(message.headers),
            delivery_info={"routing_key": message.queue},
        )
        try:
            with self._as_coordinator():
                value = task.run(*message.args, **message.kwargs)
        except REFUSALS as refused:
            with _celery_backend_writes():
                self.app.backend.mark_as_failure(
                    message.task_id, refused, traceback=traceback.format_exc()
                )
            return
        finally:
            task.pop_request()
        if message.task == messages.RUN_TASK:
            with _celery_backend_writes():
                self.app.backend.mark_as_done(message.task_id, value)

    @contextmanager
    def _as_coordinator(self) -> Iterator[None]:
        """This process as a coordinator of the harness: `runtime.current()` is its
        runtime and `messages` sends on its app (both looked up at each use)."""
        saved = runtime._current, messages.app
        runtime._current, messages.app = self.rt, self.app
        try:
            yield
        finally:
            runtime._current, messages.app = saved


@contextmanager
def _celery_backend_writes() -> Iterator[None]:
    """Celery's Redis result backend writes with `setex`, which redis-py deprecates; a
    worker (a subprocess) never turns that warning into an error, this process does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Call to deprecated setex", DeprecationWarning)
        yield


def _taken(queue: str, message: Any) -> Taken:
    """A Celery (protocol 2) message as the harness keeps it."""
    args, kwargs, _embed = message.decode()
    headers = dict(message.headers)
    return Taken(queue, headers["task"], headers["id"], list(args), dict(kwargs), headers)


class HarnessClient(Client):
    """The fleet's client on the harness's Redis prefix and broker; it drains the
    harness before it reads what a coordinator writes, and its runs do too."""

    def __init__(self, harness: TurnHarness) -> None:
        super().__init__(harness.settings, celery_app=harness.app)
        self.harness = harness

    def submit(self, request: dict[str, Any] | None = None, /, **fields: Any) -> Run[Any]:
        sent = super().submit(request, **fields)
        return HarnessRun(self, sent.run_id, sent.output_type, submitted=True)

    def run(self, run_id: str) -> Run[Any]:
        return HarnessRun(self, run_id)

    def result(self, run_id: str) -> RunResult | None:
        self.harness.drain()
        return super().result(run_id)

    def events_so_far(self, run_id: str) -> list[Event]:
        self.harness.drain()
        return super().events_so_far(run_id)

    def events(
        self, run_id: str, *, after_seq: int = 0, idle_timeout_s: float | None = None
    ) -> Iterator[Event]:
        self.harness.drain()
        return super().events(run_id, after_seq=after_seq, idle_timeout_s=idle_timeout_s)


class HarnessRun(Run[Any]):
    """A `Run` whose reads drain the harness first."""

    client: HarnessClient

    def events(self, *, after_seq: int = 0, idle_timeout_s: float | None = None) -> Iterator[Event]:
        self.client.harness.drain()
        yield from super().events(after_seq=after_seq, idle_timeout_s=idle_timeout_s)

    def wait_started(self, timeout_s: float) -> bool:
        self.client.harness.drain()
        return super().wait_started(timeout_s)
