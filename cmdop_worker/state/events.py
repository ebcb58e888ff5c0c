"""Run events: writing them (any process) and reading them back (clients).

`EventSink` is the only way an event is written: `emit` writes one, `frame` serialises
one for a script that writes it along with other state. Both take the event's data as
its model (`core.event_data.EventPayload`: one model per event type, carrying that type), so an
event's type and its data cannot disagree; `EventData.wire` gives the JSON the contract
describes. One Lua script assigns the next `seq`, appends to the run's stream and
publishes the same JSON on the run's channel, atomically — so events from the
coordinator and from every machine are totally ordered with no gaps. The script also
enforces the terminal rule: the first terminal event sets a marker, and any event after
it (from a late tool, a raced watchdog) is dropped. The marker is a one-element list
(the terminal seq), so a waiter can block on it with `BLMOVE` and wake once, when the
run ends, rather than at every event.

`follow_events` is how clients read: it replays the stream from the start and keeps
reading it with `XREAD BLOCK`, so a late or reconnecting reader sees every event once,
in order. Pub/sub carries the same events for consumers that want only the live tail.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, overload

import redis

from cmdop_worker.core.event_data import EVENT_PAYLOADS, EventPayload
from cmdop_worker.models import TERMINAL_EVENTS, Event, EventType
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.scripts import run_script

log = logging.getLogger(__name__)

# The one definition of writing an event, shared by every script that emits one (the
# plain emit below; a tool call's start and its outcome's record in `store`, so each is
# one atomic round trip). `emit(k, head, tail, ttl, maxlen)`, k = the four keys of
# `EventSink.event_keys`: returns the seq, or 0 when the run's terminal event is written.
EMIT_FUNCTION = """
local function emit(k, head, tail, ttl, maxlen)
  if redis.call('EXISTS', k[4]) == 1 then return 0 end
  local seq = redis.call('INCR', k[3])
  local ev = head .. seq .. tail
  redis.call('XADD', k[1], 'MAXLEN', '~', maxlen, '*', 'event', ev)
  redis.call('PUBLISH', k[2], ev)
  if ttl ~= '0' then
    redis.call('RPUSH', k[4], seq)
    for i = 1, 4 do
      if i ~= 2 then redis.call('EXPIRE', k[i], ttl) end
    end
  end
  return seq
end
"""

# What `json.dumps(..., ensure_ascii=False, separators=(",", ":"))` builds on every
# call, built once (the same bytes, without a new encoder per event); and the run id's
# JSON string as `json.dumps` writes it.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_ASCII = json.JSONEncoder()

_EMIT_LUA = (
    EMIT_FUNCTION
    + """
local events_key = KEYS[1]
local live_key = KEYS[2]
local seq_key = KEYS[3]
local terminal_key = KEYS[4]
local head = ARGV[1]
local tail = ARGV[2]
local ttl = ARGV[3]
local maxlen = ARGV[4]
return emit({events_key, live_key, seq_key, terminal_key}, head, tail, ttl, maxlen)
"""
)


@dataclass(frozen=True)
class Frame:
    """One event, serialised but for its seq (assigned when a script writes it)."""

    keys: list[str]
    head: str
    tail: str
    maxlen: int


class EventSink:
    """Writes a run's events. Safe to share between threads."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        maxlen: int,
        ttl_s: int,
        clock_ms: Callable[[], int],
    ) -> None:
        self._redis = client
        self._keys = keys
        self._maxlen = maxlen
        self._ttl_s = ttl_s
        self._clock_ms = clock_ms

    def event_keys(self, run_id: str) -> list[str]:
        keys = self._keys
        return [keys.events(run_id), keys.live(run_id), keys.seq(run_id), keys.terminal(run_id)]

    def frame(self, run_id: str, turn: int, data: EventPayload) -> Frame:
        """An event for a script that writes it (a non-terminal one)."""
        return self._frame(run_id, event_type_of(data), turn, data.wire())

    def _frame(self, run_id: str, type_: str, turn: int, data: dict[str, Any]) -> Frame:
        event = {"type": type_, "turn": turn, "ts_ms": self._clock_ms(), "data": data}
        body = _COMPACT.encode(event)
        head = '{"run_id":' + _ASCII.encode(run_id) + ',"seq":'
        return Frame(self.event_keys(run_id), head, "," + body[1:], self._maxlen)

    @overload
    def emit(self, run_id: str, turn: int, data: EventPayload, /) -> int: ...
    @overload
    def emit(self, run_id: str, type_: EventType, turn: int, raw: dict[str, Any], /) -> int: ...
    def emit(self, run_id: str, *event: Any) -> int:
        """Append one event; returns its seq, or 0 when the run has already ended.

        The fleet writes `(turn, data)`, one of the event models. `(type_, turn, raw)`
        writes a dict as given, unchecked: for tests that forge events, which no writer
        in the package may use (`tests/unit/state/test_events.py` holds them to that).
        """
        if len(event) == 3:
            type_, turn, raw = event
            frame = self._frame(run_id, type_, turn, raw)
        else:
            turn, data = event
            type_ = event_type_of(data)
            frame = self._frame(run_id, type_, turn, data.wire())
        ttl = str(self._ttl_s) if type_ in TERMINAL_EVENTS else "0"
        events_key, live_key, seq_key, terminal_key = frame.keys
        seq = run_script(
            self._redis,
            _EMIT_LUA,
            keys={
                "events_key": events_key,
                "live_key": live_key,
                "seq_key": seq_key,
                "terminal_key": terminal_key,
            },
            args={"head": frame.head, "tail": frame.tail, "ttl": ttl, "maxlen": frame.maxlen},
        )
        if not seq:
            log.debug("event %s for ended run %s dropped", type_, run_id)
        return int(seq)


def event_type_of(data: EventPayload) -> EventType:
    """The type of the event that carries `data`; a TypeError for anything but one of
    the event models (a dict, or `TextData`, which names neither TOKEN nor THINKING)."""
    if not isinstance(data, EVENT_PAYLOADS):
        raise TypeError(f"event data must be one of the event models, not {type(data).__name__}")
    return data.event_type


def parse_event(raw: str | bytes) -> Event:
    return Event.model_validate_json(raw)


def turn_text(client: redis.Redis, keys: Keys, run_id: str, turn: int, page: int = 64) -> str:
    """The answer text clients have already been sent for `turn` (empty unless the turn
    is being executed again after its first executor died part-way). Reads the stream
    backwards a page at a time; normally its last event is from an earlier turn."""
    pieces: list[str] = []
    newest = "+"
    while True:
        rows: list[Any] = list(client.xrevrange(keys.events(run_id), max=newest, count=page) or [])
        for entry_id, fields in rows:
            event = parse_event(fields[_field(fields)])
            if event.turn < turn:
                return "".join(reversed(pieces))
            if event.type == "TOKEN":
                pieces.append(event.data["text"])
            newest = f"({_text(entry_id)}"
        if len(rows) < page:
            return "".join(reversed(pieces))


def read_events(
    client: redis.Redis, keys: Keys, run_id: str, *, after_id: str = "-", count: int = 1000
) -> list[tuple[str, Event]]:
    """Events already in the stream after a stream id (exclusive), oldest first."""
    start = "-" if after_id == "-" else f"({after_id}"
    rows: list[Any] = list(
        client.xrange(keys.events(run_id), min=start, max="+", count=count) or []
    )
    return [(_text(entry_id), parse_event(fields[_field(fields)])) for entry_id, fields in rows]


def follow_events(
    client: redis.Redis,
    keys: Keys,
    run_id: str,
    *,
    block_ms: int = 1000,
    idle_limit_s: float | None = None,
    after_seq: int = 0,
) -> Iterator[Event]:
    """Every event of a run in order, from the first, ending after the terminal one.

    `client` must have no socket timeout shorter than `block_ms`. Gives up (returns)
    after `idle_limit_s` seconds without any event when that is set.
    """
    last_id = "0-0"
    stream = keys.events(run_id)
    idle_s = 0.0
    while True:
        try:
            reply = client.xread({stream: last_id}, block=block_ms, count=500)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Redis restarting: read on from the last entry seen once it is back.
            log.warning("reading events of %s: %s; retrying", run_id, exc)
            time.sleep(block_ms / 4000)
            reply = None
        rows = stream_rows(reply)
        if not rows:
            idle_s += block_ms / 1000
            if idle_limit_s is not None and idle_s >= idle_limit_s:
                return
            continue
        idle_s = 0.0
        for entry_id, fields in rows:
            last_id = _text(entry_id)
            event = parse_event(fields[_field(fields)])
            if event.seq <= after_seq:
                continue
            after_seq = event.seq
            yield event
            if event.is_terminal:
                return


def stream_rows(reply: Any) -> list[Any]:
    """Rows of the one stream read: RESP2 gives [[name, rows]], RESP3 {name: rows}."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return list(next(iter(reply.values())))
    return list(reply[0][1])


def _field(fields: dict[Any, Any]) -> Any:
    return "event" if "event" in fields else b"event"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
