"""Reading a run's events from asyncio code: what a server with many followers uses.

`follow_events_async` is `events.follow_events` for an event loop: it reads the run's
stream from the first entry with `XREAD BLOCK`, skips events up to `after_seq` and
ends after the terminal event, so a reader that reconnects with the last seq it saw
gets every later event once, in order. Each follower holds one connection of an
asyncio client while it blocks, not a thread. `progress` says where a run's events
stand (last seq, ended or not) without reading them. Called by the HTTP gateway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from cmdop_worker.models import Event
from cmdop_worker.state.events import parse_event, stream_rows
from cmdop_worker.state.keys import Keys

log = logging.getLogger(__name__)


def async_redis_client(url: str) -> aioredis.Redis:
    """An asyncio client whose reads wait as long as `XREAD BLOCK` needs."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=None,
        socket_connect_timeout=5,
        health_check_interval=15,
        retry_on_timeout=True,
    )


@dataclass(frozen=True)
class Progress:
    exists: bool  # the run has a record, events or a result
    last_seq: int  # the seq of its newest event (0: none yet)
    ended: bool  # its terminal event is written


async def progress(client: aioredis.Redis, keys: Keys, run_id: str) -> Progress:
    async with client.pipeline(transaction=False) as pipe:
        pipe.exists(keys.state(run_id), keys.events(run_id), keys.result(run_id))
        pipe.get(keys.seq(run_id))
        pipe.exists(keys.terminal(run_id))
        found, seq, ended = await pipe.execute()
    return Progress(exists=bool(found), last_seq=int(seq or 0), ended=bool(ended))


async def follow_events_async(
    client: aioredis.Redis,
    keys: Keys,
    run_id: str,
    *,
    after_seq: int = 0,
    block_ms: int = 1000,
) -> AsyncIterator[Event]:
    """Every event of a run after `after_seq`, in order, ending after the terminal one."""
    last_id = "0-0"
    stream = keys.events(run_id)
    while True:
        try:
            reply = await client.xread({stream: last_id}, block=block_ms, count=500)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Redis restarting: read on from the last entry seen once it is back.
            log.warning("reading events of %s: %s; retrying", run_id, exc)
            await asyncio.sleep(block_ms / 4000)
            continue
        for entry_id, fields in stream_rows(reply):
            last_id = entry_id
            event = parse_event(fields["event"])
            if event.seq <= after_seq:
                continue
            after_seq = event.seq
            yield event
            if event.is_terminal:
                return
