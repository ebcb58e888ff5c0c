"""A run's start in flight: the `cmdop.run` a client sent, until a coordinator holds it.

Why: kombu's Redis transport takes a message off its queue (BRPOP) before it records it
as unacknowledged, so a coordinator killed in between loses the message for good — no
visibility timeout brings it back (celery#7950, #4354) — and with it the whole run,
which nothing else knows of yet. Every later message of a run is covered by the run's
own watchdog entries; this one is covered by its sender's.

So `Client.submit` leaves the request and a watchdog entry (`start:<run>`, due a grace
after the send) before it sends (`expected`: dropped again if the send raises, as its
caller is told the start failed), and so does a coordinator that sends the start of a
run that waited for its thread (`coordinator.threads`, `coordinator.runs`). The
`cmdop.run` task drops both once it has handled the request (`handled`): from the
moment a coordinator read the message it sat in kombu's unacknowledged index, which
brings it back if that coordinator dies. An entry that comes due means the start may
have been lost: the watchdog sends the same `cmdop.run` again (`due_again`), under the
same task id, each time after twice as long. A second copy of a start that was only
slow is harmless: a run is stored once, and a redelivered start finds its own run
(`coordinator.runs.start_run`).

A `cmdop.run` sent by another service with a bare `send_task` leaves no entry: a
coordinator killed at that moment still loses it, as with any Celery message on Redis.

Who calls it: the senders above (`expect`, `expected`), the `cmdop.run` task
(`handled`), the watchdog (`due_again`). Plain commands, no script: every race between them ends in
one extra, harmless, copy of the start.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import redis

from cmdop_worker.state.keys import Keys, start_member

# A coordinator reads a start within milliseconds; one still unhandled this long after
# it was sent (or sent again) may have been lost, and is sent again.
START_GRACE_MS = 5_000
# However long a start waits, it is sent again at least this often...
START_RESEND_MAX_MS = 300_000
# ...for as long as a run may last at most: a start unhandled for longer is let go.
START_TTL_S = 3_600


def expect(client: redis.Redis, keys: Keys, request: dict[str, Any], *, now_ms: int) -> None:
    """Before `request`'s `cmdop.run` is sent: keep it, and have the watchdog look at
    it a grace later."""
    run_id = str(request["run_id"])
    record = json.dumps({"request": request, "sent_ms": now_ms})
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.start(run_id), record, ex=START_TTL_S)
    pipe.zadd(keys.deadlines, {start_member(run_id): now_ms + START_GRACE_MS})
    pipe.execute()


@contextmanager
def expected(
    client: redis.Redis, keys: Keys, request: dict[str, Any], *, now_ms: int
) -> Iterator[None]:
    """`expect` for a send in the block; undone when the send raises, since its caller,
    told that the start failed, may submit it again (`Client.submit`)."""
    expect(client, keys, request, now_ms=now_ms)
    try:
        yield
    except BaseException:
        handled(client, keys, str(request["run_id"]))
        raise


def handled(client: redis.Redis, keys: Keys, run_id: str) -> None:
    """A coordinator has handled the start (stored the run, queued it on its thread,
    or refused it): nothing is left to send again."""
    pipe = client.pipeline(transaction=True)
    pipe.zrem(keys.deadlines, start_member(run_id))
    pipe.delete(keys.start(run_id))
    pipe.execute()


@dataclass(frozen=True)
class Unhandled:
    """A start to send again: its request, and when it was first sent."""

    request: dict[str, Any]
    sent_ms: int


def due_again(client: redis.Redis, keys: Keys, run_id: str, *, now_ms: int) -> Unhandled | None:
    """The start to send again, its entry put off by as long as it has waited so far
    (at least a grace, at most `START_RESEND_MAX_MS`); None when the start was handled
    or has expired (the watchdog then drops the entry)."""
    raw = cast("str | bytes | None", client.get(keys.start(run_id)))
    if raw is None:
        return None
    record = json.loads(raw)
    waited = now_ms - int(record["sent_ms"])
    wait = min(max(START_GRACE_MS, waited), START_RESEND_MAX_MS)
    client.zadd(keys.deadlines, {start_member(run_id): now_ms + wait})
    return Unhandled(cast("dict[str, Any]", record["request"]), int(record["sent_ms"]))
