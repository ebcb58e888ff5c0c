"""Which tasks a message may carry, by the queue it arrived on: the continuation queue
takes continuations only.

Machine workers push onto `cmdop.coordinator.next` (`CONTINUATION_QUEUE`) and never
onto `cmdop.coordinator` (their ACL, `state.acl`): the next turn once a turn's results
are in, a sequential turn's next call, a coordinator tool whose turn has come. Each of
them acts on a run that exists, and only as far as its stored state allows. A message
that arrived there naming any other task — `cmdop.run`, `cmdop.tool`, one of Celery's
own (`celery.map` calls the task it is given) — is acknowledged and dropped, with a
warning, before Celery sees it: credentials taken from a machine start no run.

The queue a message arrived on must come from the consumer, not from the message:
kombu's Redis transport keeps the publisher's `delivery_info` (exchange and routing
key) inside the message, so a forged message could name any queue. `_stamp_arrival`
overwrites it, as each message is delivered, with the queue the transport popped it
from (and the anonymous exchange, so a restored message goes back to that queue too,
never to one its publisher named). On RabbitMQ the broker names the consumer each
message is delivered to (its consumer tag, which the consumer was given for one
queue), so the queue is that consumer's.

A continuation also carries nothing for Celery to run after it: its `callbacks`,
`errbacks`, `chain` and `chord` must be empty, or a pushed `cmdop.turn` for no run at
all would have Celery send the `cmdop.run` in its callbacks. And a message that is no
message (not JSON, or JSON without kombu's properties) is dropped with a warning where
the Redis transport pops it: kombu would otherwise raise in the consumer and stop the
worker, so one push of `x` would stop every coordinator.

`admits` is the decision (pure); `install` patches kombu 5.7 (the Redis transport's
delivery, and every consumer's receive callback) once per process.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu import messaging
from kombu.transport import redis as kombu_redis

from cmdop_worker.state.keys import CONTINUATION_QUEUE

log = logging.getLogger(__name__)

# The tasks a machine worker sends to coordinators: each continues a run it names.
CONTINUATIONS = frozenset({"cmdop.turn", "cmdop.hand_on", "cmdop.local_tool"})


# What Celery runs after a task (protocol 2's embed): a continuation has none of it.
FOLLOW_UPS = ("callbacks", "errbacks", "chain", "chord")


def admits(queue: str | None, task: object, embed: object = None) -> bool:
    """Whether a message naming `task`, with protocol 2's `embed`, may run, having
    arrived on `queue`."""
    if queue != CONTINUATION_QUEUE:
        return True
    if not (isinstance(task, str) and task in CONTINUATIONS and isinstance(embed, dict)):
        return False
    return not any(embed.get(name) for name in FOLLOW_UPS)


def _embed_of(message: Any) -> object:
    """Protocol 2's third body part, or None when the body is not `[args, kwargs, embed]`."""
    try:
        body = message.decode()
    except Exception:  # an undecodable body is no continuation this fleet sends
        return None
    return body[2] if isinstance(body, list | tuple) and len(body) == 3 else None


class Unreadable(dict[str, Any]):
    """What the Redis transport read in place of a message that is not JSON."""


def _tolerant(loads: Any) -> Any:
    def read(text: Any) -> Any:
        try:
            return loads(text)
        except ValueError:
            return Unreadable(text=str(text)[:80])

    read.cmdop_patched = True  # type: ignore[attr-defined]
    return read


def _task_of(headers: object) -> object:
    # Protocol 2 names the task in a header; a message without one (protocol 1 names
    # it in the body) is no continuation this fleet sends.
    return headers.get("task") if isinstance(headers, dict) else None


def _stamp_arrival(deliver: Any) -> Any:
    def stamped(self: kombu_redis.Transport, message: Any, queue: str) -> Any:
        properties = message.get("properties") if isinstance(message, dict) else None
        if isinstance(message, Unreadable) or not isinstance(properties, dict):
            shown = message.get("text") if isinstance(message, Unreadable) else message
            log.warning("dropped a message on %s that is no kombu message: %.80r", queue, shown)
            return None
        info = properties.get("delivery_info")
        info = dict(info) if isinstance(info, dict) else {}
        info.pop("consumer_tag", None)  # kombu's Redis deliveries carry none of their own
        info.update(exchange="", routing_key=queue)
        properties["delivery_info"] = info
        return deliver(self, message, queue)

    stamped.cmdop_patched = True  # type: ignore[attr-defined]
    return stamped


def _gate(receive: Any) -> Any:
    def gated(self: messaging.Consumer, message: Any) -> Any:
        queue = arrived_on(message, getattr(self, "_active_tags", None) or {})
        task = _task_of(getattr(message, "headers", None))
        # An AMQP channel hands over the broker's raw message: decode it as kombu would.
        m2p = getattr(self.channel, "message_to_python", None)
        embed = _embed_of(m2p(message) if m2p else message) if queue == CONTINUATION_QUEUE else None
        if admits(queue, task, embed):
            return receive(self, message)
        log.warning(
            "refused a message for task %r that arrived on %s, which takes only %s "
            "with nothing to run after them; dropped unrun (task id %r)",
            task,
            queue,
            ", ".join(sorted(CONTINUATIONS)),
            _task_id_of(message),
        )
        (m2p(message) if m2p else message).ack()
        return None

    gated.cmdop_patched = True  # type: ignore[attr-defined]
    return gated


def arrived_on(message: Any, tags: dict[str, str]) -> str | None:
    """The queue a delivered message came from: the one its consumer tag was given for
    (AMQP: the broker names the consumer a message is for), else its routing key (as
    the broker set it, or `_stamp_arrival` on Redis)."""
    info = getattr(message, "delivery_info", None)
    if not isinstance(info, dict):
        return None
    tag = info.get("consumer_tag")
    by_tag = [queue for queue, given in tags.items() if tag is not None and given == tag]
    if by_tag:
        return by_tag[0]
    key = info.get("routing_key")
    return key if isinstance(key, str) else None


def _task_id_of(message: Any) -> object:
    headers = getattr(message, "headers", None)
    return headers.get("id") if isinstance(headers, dict) else None


def install() -> None:
    """Patch kombu once: stamp the real queue on every Redis delivery, and gate every
    consumer's messages by it."""
    if not getattr(kombu_redis.loads, "cmdop_patched", False):
        kombu_redis.loads = _tolerant(kombu_redis.loads)
    deliver = kombu_redis.Transport._deliver
    if not getattr(deliver, "cmdop_patched", False):
        kombu_redis.Transport._deliver = _stamp_arrival(deliver)  # type: ignore[method-assign]
    receive = messaging.Consumer._receive_callback
    if not getattr(receive, "cmdop_patched", False):
        messaging.Consumer._receive_callback = _gate(receive)  # type: ignore[method-assign]
