"""Every message the fleet puts on the broker: it is to Celery what `state.keys` is to Redis.

Each message is an `Outgoing`, made by one builder here, and goes out through `send`
alone or `publish` with the rest of a turn's fan-out: the same Celery message either
way (Celery's own `send_task`, its routing, properties and signals). Nothing else in
the package calls `send_task`, `apply_async` or `delay` (`lint-imports` and
`tests/unit/test_architecture.py` hold that). `tasks` registers each task under the
name given here.

    task              queue                   task id                    builder
    cmdop.run         cmdop.coordinator       <run>.start                run_message
    cmdop.turn        cmdop.coordinator.next  <run>.turn.<n>             turn_message
    cmdop.tool        cmdop.machine.<name>    <run>.<call>               tool_message
    cmdop.tool        cmdop.machine.<name>    <run>.<call>.<verdict>     answer_message
    cmdop.local_tool  cmdop.coordinator.next  <run>.<call>               local_tool_message
    cmdop.hand_on     cmdop.coordinator.next  <run>.<call>.hand_on       hand_on_message

A task id is the message's identity: a second send of the same turn or call is the
same task, so redelivery and resending are harmless. Headers carry the trace context
of the turn that made a call (`traceparent`, `tracing.trace_headers`); a coordinator
tool's message also carries its deadline as handed out, and a client's `cmdop.run`
the time it was first sent (`SENT_MS_HEADER`). An answer's task expires
(`ANSWER_TASK_EXPIRES_S`): the watchdog has sent a newer one by then.

Who sends: the turn's tool calls and its reply (`coordinator.calls`: `publish`,
`enqueue_turn`; `coordinator.reply`), `outcomes` (the next turn, the next call of a
sequential turn), `coordinator.recovery` (re-sending), `coordinator.runs`, `threads`
and `watchdog` (`send_start`: a run that waited for its thread, or a client's start
that no coordinator handled, sent again (`state.starts`)), the approvals on both
sides (`answer_message`, `send_answer`) and `surfaces.client` (`cmdop.run`).

A turn's fan-out goes out in one round trip (`publish`, called by `calls` with the
machine calls of a parallel turn; a coordinator task may ride along). Each message is
handed to Celery exactly as a lone one; only the transport step is shared:

- Redis: kombu's own publish batch (`Producer.batch`, kombu 5.7). Its Redis channel
  routes each message as a lone publish does (delivery tag, priority queue name,
  `global_keyprefix`, queue expiry) and buffers the LPUSH; the batch sends all of them
  in one non-transactional pipeline at the end. `after_task_publish` thus fires when a
  message is buffered; nothing of ours listens to it.
- RabbitMQ: one channel for all. Without publisher confirms (the default) a publish
  never waits anyway. With them (`CMDOP_BROKER_CONFIRM_PUBLISH`), a channel of its own
  in confirm mode takes every message, and the confirms are awaited once for all.
- Any other broker: kombu's batch publishes each at once, on one producer.

A lone message goes the ordinary way, with kombu's retry on a lost connection; a batch
has none. So a fan-out whose pipeline failed (`BatchPublishError`: an unknown part of
it was pushed), or failed to be built (nothing was), is sent again one message at a
time: at least once, as after a broker's redelivery (a call starts once,
`RunStore.start_call`; a turn executes once, its lease).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kombu.exceptions import OperationalError

from cmdop_worker.celery_app import DECLARE_ON_PUBLISH, app
from cmdop_worker.models import ApprovalAnswer, ToolCall
from cmdop_worker.state.keys import CONTINUATION_QUEUE, COORDINATOR_QUEUE, machine_queue

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Producer

log = logging.getLogger(__name__)

RUN_TASK = "cmdop.run"
TURN_TASK = "cmdop.turn"
TOOL_TASK = "cmdop.tool"
LOCAL_TOOL_TASK = "cmdop.local_tool"
HAND_ON_TASK = "cmdop.hand_on"
# A carrying task still queued that long after it was sent is dropped unrun: by then the
# watchdog has sent a newer one, or the call has an outcome without it.
ANSWER_TASK_EXPIRES_S = 3_600
# When a client first sent a `cmdop.run` (epoch ms): the run's `timeout_s` counts from
# then, so a start no coordinator took by its deadline ends CANCELLED, never runs later.
SENT_MS_HEADER = "cmdop_sent_ms"
# What a send raises when the broker cannot be reached (after kombu's own retries).
SEND_FAILURES: tuple[type[Exception], ...] = (OSError, OperationalError)
# Longer than any fan-out (a turn's calls): one pipeline, never flushed part way.
_BATCH_MAX = 10_000


class TaskSender(Protocol):
    """What sends a Celery task: the app of a worker, or the one a client was given."""

    def send_task(self, name: str, *args: Any, **options: Any) -> Any: ...


@dataclass(frozen=True)
class Outgoing:
    """A task message of the fleet, as `send` publishes it alone and `publish` with
    the rest of a turn's fan-out: the same Celery message."""

    task: str
    queue: str
    task_id: str
    args: Sequence[Any] = ()  # a list, as `argsrepr` has always shown it
    kwargs: dict[str, Any] | None = None
    headers: Mapping[str, Any] | None = None
    argsrepr: str | None = None
    kwargsrepr: str | None = None
    expires_s: int | None = None
    # Every task but `cmdop.run` (whose result a client reads) declares ignore_result.
    ignore_result: bool = True


def run_message(
    request: dict[str, Any], *, shown: str | None = None, sent_ms: int | None = None
) -> Outgoing:
    """`cmdop.run` under the task id a client follows (`<run_id>.start`); `shown`, what
    Flower shows for its kwargs instead of the whole request; `sent_ms`, when its sender
    first sent it (header `SENT_MS_HEADER`): the run's deadline counts from then."""
    return Outgoing(
        RUN_TASK,
        COORDINATOR_QUEUE,
        f"{request['run_id']}.start",
        kwargs={"request": request},
        headers={SENT_MS_HEADER: sent_ms} if sent_ms is not None else None,
        argsrepr="()" if shown is not None else None,
        kwargsrepr=shown,
        ignore_result=False,
    )


def sent_ms_of(headers: Mapping[str, Any] | None) -> int | None:
    """The time a `cmdop.run` was first sent, from its headers (None: not stamped, as a
    bare `send_task` of another service is not)."""
    value = (headers or {}).get(SENT_MS_HEADER)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def turn_message(run_id: str, turn: int) -> Outgoing:
    # The task id is the turn's: a second enqueue of the same turn is the same task.
    return Outgoing(TURN_TASK, CONTINUATION_QUEUE, f"{run_id}.turn.{turn}", [run_id, turn])


def tool_message(call: ToolCall, headers: Mapping[str, Any]) -> Outgoing:
    """A machine call for its machine's queue, with the trace context of its turn."""
    shown = {"run_id": call.run_id, "turn": call.turn, "tool": call.tool, "machine": call.machine}
    return Outgoing(
        TOOL_TASK,
        machine_queue(call.machine),
        f"{call.run_id}.{call.tool_use_id}",
        kwargs={"call": call.model_dump(mode="json")},
        headers=headers,
        kwargsrepr=repr(shown),
    )


def answer_message(call: ToolCall, answer: ApprovalAnswer) -> Outgoing:
    """The `cmdop.tool` task that carries a person's answer to a parked call's machine.
    Sent again while it is not taken, each copy is the same task: the machine acts on
    one (`state.approvals`, `take`)."""
    carried = call.model_copy(update={"approval": answer})
    return Outgoing(
        TOOL_TASK,
        machine_queue(call.machine),
        f"{call.run_id}.{call.tool_use_id}.{answer.verdict}",
        kwargs={"call": carried.model_dump(mode="json")},
        kwargsrepr=repr({"run_id": call.run_id, "tool": call.tool, "verdict": answer.verdict}),
        expires_s=ANSWER_TASK_EXPIRES_S,
    )


def local_tool_message(
    run_id: str, turn: int, tool_use_id: str, *, deadline_ms: int, headers: Mapping[str, Any]
) -> Outgoing:
    """A coordinator tool for a coordinator to run (`cmdop.local_tool`), by the deadline
    it was given when sent (0: the one planned at dispatch), under its turn's trace."""
    args = [run_id, turn, tool_use_id, deadline_ms or None]
    return Outgoing(
        LOCAL_TOOL_TASK, CONTINUATION_QUEUE, f"{run_id}.{tool_use_id}", args, headers=headers
    )


def hand_on_message(
    run_id: str, turn: int, tool_use_id: str, *, headers: Mapping[str, Any]
) -> Outgoing:
    """A sequential turn's machine call that a machine hands to a coordinator to send
    on: a machine pushes onto its own queue and the continuation queue only."""
    task_id = f"{run_id}.{tool_use_id}.hand_on"
    args = [run_id, turn, tool_use_id]
    return Outgoing(HAND_ON_TASK, CONTINUATION_QUEUE, task_id, args, headers=headers)


def send(
    message: Outgoing, producer: Producer | None = None, *, via: TaskSender | None = None
) -> None:
    """Publish one message through Celery's own `send_task` (on `producer`, if given),
    on `via`, else this process's app (looked up now: a test may point it elsewhere)."""
    sender = app if via is None else via
    # Only the options given: any other (even None) would end up in the message's
    # properties. `ignore_result` as the task sent declares it, as `apply_async` would.
    given: dict[str, Any] = {
        "headers": dict(message.headers) if message.headers is not None else None,
        "argsrepr": message.argsrepr,
        "kwargsrepr": message.kwargsrepr,
        "expires": message.expires_s,
        "ignore_result": True if message.ignore_result else None,
    }
    # An app made without our settings (a client's own) declares as Celery does.
    if not getattr(sender, "conf", {}).get(DECLARE_ON_PUBLISH, True):
        given["declare"] = []
    sender.send_task(
        message.task,
        args=message.args,
        kwargs=message.kwargs,
        queue=message.queue,
        task_id=message.task_id,
        producer=producer,
        **{name: value for name, value in given.items() if value is not None},
    )


def enqueue_turn(run_id: str, turn: int) -> None:
    send(turn_message(run_id, turn))


def send_start(request: dict[str, Any], *, sent_ms: int | None = None) -> None:
    """Send `cmdop.run` for a request that waited for its thread, or again for a
    client's start that no coordinator handled in time (the watchdog, `state.starts`:
    `sent_ms`, when the client first sent it)."""
    send(run_message(request, sent_ms=sent_ms))


def send_answer(via: TaskSender, call: ToolCall, answer: ApprovalAnswer) -> None:
    """Send the task that carries `answer` to the call's machine, on `via` (a client's
    app, or a coordinator's)."""
    send(answer_message(call, answer), via=via)


def publish(messages: Sequence[Outgoing], *, via: Celery | None = None) -> None:
    """Publish `messages` in one go where the broker allows it (the module docstring)."""
    sender = app if via is None else via
    if len(messages) > 1 and _published_together(messages, sender):
        return
    for message in messages:
        send(message, via=sender)


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
