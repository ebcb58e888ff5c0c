"""A turn's fan-out in one round trip: its messages published together.

Called by `dispatch.send_calls` with the machine calls of a parallel turn (any list of
`outcomes.Outgoing` will do: a coordinator task may ride along). Each message is built
and handed to Celery exactly as any lone message of the fleet (`outcomes.send`:
`send_task`, with its routing, headers, properties, body encoding,
`before/after_task_publish` signals and, when enabled, "task-sent" events); only the
transport step is shared:

- Redis: kombu's own publish batch (`Producer.batch`, kombu 5.7). Its Redis channel
  routes each message as a lone publish does (`basic_publish`, `_put`: delivery tag,
  priority queue name, `global_keyprefix`, queue expiry) and buffers the LPUSH instead
  of sending it; the batch sends all of them in one non-transactional pipeline at the
  end. (kombu publishes each at once instead where a client would replay a pipeline on
  a retry.) `after_task_publish` thus fires when a message is buffered, just before the
  pipeline is sent; nothing of ours listens to it (trace context travels in the
  messages' headers, `tracing.trace_headers`).
- RabbitMQ: one channel for all. Without publisher confirms (the default) a publish
  never waits for the broker anyway. With them (`CMDOP_BROKER_CONFIRM_PUBLISH`), a
  channel of its own in confirm mode takes every message, and the broker's confirms
  are then awaited once for all instead of one round trip per message.
- Any other broker: kombu's batch publishes each at once, on one producer.

A lone message goes the ordinary way, with kombu's retry on a lost connection; a batch
has no retry of its own. So a fan-out whose pipeline failed (kombu's
`BatchPublishError`: an unknown part of it was pushed), or failed to be built (nothing
was), is sent again one message at a time, each retried as a lone one is: at least
once, as after a broker's redelivery (a call starts once, `RunStore.start_call`; a turn
executes once, its lease).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cmdop_worker.celery_app import app
from cmdop_worker.outcomes import Outgoing, send

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

# Longer than any fan-out (a turn's calls): one pipeline, never flushed part way.
_BATCH_MAX = 10_000


def publish(messages: Sequence[Outgoing], *, via: Celery = app) -> None:
    """Publish `messages` in one go where the broker allows it (the module docstring)."""
    if len(messages) > 1 and _published_together(messages, via):
        return
    for message in messages:
        send(message, via=via)


def _published_together(messages: Sequence[Outgoing], via: Celery) -> bool:
    """False when the batch failed, having sent all, part or none of the messages."""
    with via.producer_or_acquire() as producer:
        if _confirms_each(producer):
            _publish_confirmed(producer, messages, via)
            return True
        try:
            with producer.batch(max_size=_BATCH_MAX):
                for message in messages:
                    send(message, producer, via=via)
        # The pipeline failed (`BatchPublishError`: an unknown part of it was pushed), or
        # building it did (a connection lost while declaring a queue: nothing was sent).
        except Exception as exc:
            log.warning("a fan-out of %d failed (%r); sending each again", len(messages), exc)
            return False
    return True


def _confirms_each(producer: Any) -> bool:
    """True on an AMQP connection whose every publish waits for the broker's confirm."""
    connection = producer.connection
    return connection.transport.driver_type == "amqp" and bool(
        getattr(connection.connection, "confirm_publish", False)
    )


def _publish_confirmed(producer: Any, messages: Sequence[Outgoing], via: Celery) -> None:
    """Publish on a new channel in confirm mode, then await every confirm at once."""
    from amqp import spec
    from amqp.exceptions import MessageNacked
    from kombu import Producer

    # A channel of our own: its confirms count from 1, so we know which are ours.
    channel = producer.connection.channel()
    try:
        channel.confirm_select()
        channel._confirm_selected = True
        channel.basic_publish = channel._basic_publish  # publish without waiting...
        confirmed: set[int] = set()
        nacked: list[int] = []

        def on_ack(tag: int, multiple: bool) -> None:
            confirmed.update(range(1, tag + 1) if multiple else (tag,))

        def on_nack(tag: int, multiple: bool) -> None:
            nacked.append(tag)
            on_ack(tag, multiple)

        channel.events["basic_ack"].add(on_ack)
        channel.events["basic_nack"].add(on_nack)
        own = Producer(channel, auto_declare=False)
        for message in messages:
            send(message, own, via=via)
        while len(confirmed) < len(messages):  # ...and wait once for them all
            channel.wait([spec.Basic.Ack, spec.Basic.Nack])
        if nacked:
            raise MessageNacked(f"the broker refused {len(nacked)} of {len(messages)} messages")
    finally:
        channel.close()
