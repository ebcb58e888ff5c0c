"""The Celery application every process of the fleet shares.

`celery -A cmdop_worker.celery_app worker -Q cmdop.coordinator,cmdop.coordinator.next`
and Flower load `app` from here; `cmdop-worker worker` does the same with the right
queues and flags. The settings below are chosen so that a run survives a worker killed
at any moment:

- `task_acks_late` + `task_reject_on_worker_lost`: a task is acknowledged only when it
  has finished, so a SIGKILLed worker's task goes back to the queue instead of being
  lost. Every task is idempotent (a turn that already advanced does nothing; a tool
  whose outcome is stored is not run again; one that started but never reported is
  answered "outcome unknown"), so a redelivery is safe.
- `worker_prefetch_multiplier=1`: a worker holds no more unacknowledged messages than
  it is running, so a crash strands as little as possible.
- `visibility_timeout` (Redis broker) above the longest task — a tool may run 600 s —
  or Redis would hand a still-running task to a second worker. All workers share it.
  A second copy does no harm (a turn is locked, a started tool is not run again), it
  only costs a redelivery, so tests set it to seconds to make crashes recover fast.
- `unacked_restore_interval` times `unacked_restore_throttle` (Redis broker): how often
  kombu looks for messages of a dead worker whose visibility timeout has passed;
  kombu's 10 s times 10 add up to 100 s to a recovery. Configurable; tests use 1 and 1.
- A machine worker keeps its unacknowledged messages under keys of its own (kombu's
  `unacked_key` and its kin, `state.acl.machine_unacked_keys`): kombu's default keys
  are shared by every worker, which would let one machine's Redis user read another's
  calls in flight. Only the machine itself restores them, after a crash, as it alone
  consumes its queue.
- A machine worker logged in as a named Redis user takes no remote control
  (`takes_remote_control`), and sends to other queues without declaring them
  (`declares_on_publish`): both would need Redis rights its user does not have.
- Redis transport options go only to a Redis broker: AMQP has no visibility timeout
  (RabbitMQ redelivers a dead consumer's unacknowledged messages when its channel
  closes), so a RabbitMQ broker gets none of them; it gets publisher confirms
  (`confirm_publish`) when `CMDOP_BROKER_CONFIRM_PUBLISH` asks for them.
- A machine worker's broker poll (`polling_interval`, kombu's BRPOP timeout) is
  `MACHINE_BROKER_POLL_S`, not kombu's 1 s: an idle machine's BRPOP was a third of its
  Redis commands. A message still arrives at once (BRPOP returns with it), and a
  cancel reaches a running tool by pub/sub, never through the broker. Only machine
  workers get it: kombu also sleeps `polling_interval` between polls where it drains
  synchronously (a client's `celery inspect`, Flower), which machines never do.
- Continuations (`cmdop.turn`, `cmdop.hand_on`, `cmdop.local_tool`) go to
  `cmdop.coordinator.next`, the only coordinator queue a machine's ACL user may push
  onto; a message there that names any other task is dropped unrun (`state.arrival`).
- `worker_cancel_long_running_tasks_on_connection_loss`: a tool with side effects is not
  left running unobserved when the broker connection drops.
- JSON only: a pickled message is refused, never unpickled.
- Task events only when someone watches (`CMDOP_TASK_EVENTS`, off by default): Flower
  turns workers' events on when it starts, and again every 5 s for workers started
  later, and then sees every task from "received" on (not while queued: "sent" events
  are the publisher's, which only the setting turns on). Sent with nobody listening,
  they were ~5% of a run's time.

Two patches to kombu 5.7's Redis transport. One to its robustness
(`_survive_lost_broker`): when the broker
connection drops while a task is running, kombu closes the channel and then hands that
task's message back — and later acknowledges it when the task ends — through the
channel it has just torn down; the AttributeError kills the whole worker
("Unrecoverable error"), so a Redis restart took down every busy worker. The message
is still in kombu's unacked index in Redis, which the visibility-timeout sweep
restores, and every task is idempotent, so the failed call is logged and skipped and
the worker lives on.

And one to its cost (`_reuse_publish_clients`): the Redis channel builds a new
`redis.Redis` for every publish, acknowledgement and unacked-index update
(`Channel.conn_or_acquire`), ~0.1 ms of CPU each and several per task — a tenth of a
machine worker's CPU per tool call. Each channel now keeps one, built the same way,
and builds it again only when the channel's connection pool is replaced (a client is
thread-safe: it takes a pooled connection per command).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from celery import Celery
from kombu.transport import redis as kombu_redis

from cmdop_worker.config import Settings
from cmdop_worker.state import arrival
from cmdop_worker.state.acl import machine_unacked_keys
from cmdop_worker.state.keys import CONTINUATION_QUEUE, COORDINATOR_QUEUE

# Our own key in the app's configuration: see `declares_on_publish`.
DECLARE_ON_PUBLISH = "cmdop_declare_on_publish"
MACHINE_BROKER_POLL_S = 5.0
_REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://", "sentinel://", "unix://")


def celery_config(settings: Settings) -> dict[str, Any]:
    return {
        "broker_url": celery_url(settings.effective_broker_url),
        "result_backend": celery_url(settings.redis_url),
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": broker_transport_options(settings),
        "result_backend_transport_options": {"retry_policy": {"timeout": 5.0}},
        "result_expires": settings.run_ttl_s,
        "task_default_queue": COORDINATOR_QUEUE,
        "task_routes": {
            "cmdop.run": {"queue": COORDINATOR_QUEUE},
            "cmdop.turn": {"queue": CONTINUATION_QUEUE},
            "cmdop.hand_on": {"queue": CONTINUATION_QUEUE},
            "cmdop.local_tool": {"queue": CONTINUATION_QUEUE},
        },
        "worker_enable_remote_control": takes_remote_control(settings),
        DECLARE_ON_PUBLISH: declares_on_publish(settings),
        "worker_send_task_events": settings.task_events,
        "task_send_sent_event": settings.task_events,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "worker_hijack_root_logger": False,
        "task_track_started": True,
        "enable_utc": True,
    }


def celery_url(url: str) -> str:
    """The URL as Celery reads it: a Redis on a unix socket is `unix:///path` to
    redis-py (the state layer) but `redis+socket:///path` to Celery and kombu."""
    if url.startswith("unix://"):
        return "redis+socket://" + url.removeprefix("unix://")
    return url


def takes_remote_control(settings: Settings) -> bool:
    """Whether the worker listens to Celery's remote control (`celery inspect`, Flower's
    worker list and its "enable events"). It is one broadcast channel that every worker
    obeys, shutdown included, so a machine's own Redis user (`state.acl`) may not use
    it: a machine worker that logs in as a named user does not listen there."""
    if settings.machine is None:
        return True
    try:
        user = urlsplit(settings.effective_broker_url).username
    except ValueError:
        return True
    return user in (None, "", "default")


def declares_on_publish(settings: Settings) -> bool:
    """Whether `messages.send` declares a queue before its first message there. A
    machine worker on Redis does not: Redis routes the fleet's messages to a queue by
    its name alone, and declaring writes the exchange's binding table, which a
    machine's ACL user may not (a binding it added would route another queue's
    messages to its own). AMQP drops a message to a queue nobody declared."""
    redis_broker = settings.effective_broker_url.startswith(_REDIS_SCHEMES)
    return settings.machine is None or not redis_broker


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    if not settings.effective_broker_url.startswith(_REDIS_SCHEMES):
        return {"confirm_publish": True} if settings.broker_confirm_publish else {}
    options: dict[str, Any] = {
        "visibility_timeout": settings.visibility_timeout_s,
        "unacked_restore_interval": settings.broker_restore_interval_s,
        "unacked_restore_throttle": settings.broker_restore_throttle,
        # No message of the fleet has a priority: one list per queue, whose name an ACL
        # can grant exactly (kombu's other steps are `<queue>\x06\x16<n>`).
        "priority_steps": [0],
    }
    if settings.broker_key_prefix:
        options["global_keyprefix"] = settings.broker_key_prefix
    if settings.machine is not None:
        options.update(machine_unacked_keys(settings.machine))
        options["polling_interval"] = MACHINE_BROKER_POLL_S
    return options


def _survive_lost_broker() -> None:
    for name in ("restore_unacked", "ack", "reject"):
        method = getattr(kombu_redis.QoS, name)
        if not getattr(method, "cmdop_patched", False):
            setattr(kombu_redis.QoS, name, _tolerant(method))


def _tolerant(method: Any) -> Any:
    def call(self: kombu_redis.QoS, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except AttributeError as exc:  # the channel's connection is already gone
            logging.getLogger(__name__).warning(
                "kombu %s on a closed broker channel skipped (%r); the message stays "
                "unacknowledged in Redis and the visibility timeout restores it",
                method.__name__,
                exc,
            )
            return None

    call.cmdop_patched = True  # type: ignore[attr-defined]
    return call


def _reuse_publish_clients() -> None:
    if getattr(kombu_redis.Channel.conn_or_acquire, "cmdop_patched", False):
        return

    @contextmanager
    def conn_or_acquire(self: kombu_redis.Channel, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        pool = self.pool
        cached = self.__dict__.get("_cmdop_client")
        if cached is None or cached[0] is not pool:  # first use, or the pool was replaced
            cached = (pool, self._create_client())
            self.__dict__["_cmdop_client"] = cached
        yield cached[1]

    conn_or_acquire.cmdop_patched = True  # type: ignore[attr-defined]
    conn_or_acquire.cmdop_original = kombu_redis.Channel.conn_or_acquire  # type: ignore[attr-defined]
    kombu_redis.Channel.conn_or_acquire = conn_or_acquire  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings.from_env()
    celery = Celery("cmdop", include=["cmdop_worker.tasks"])
    celery.conf.update(celery_config(settings))
    return celery


_survive_lost_broker()
_reuse_publish_clients()
arrival.install()
app = create_app()
