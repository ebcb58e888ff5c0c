"""Machine presence: which machine workers are alive and what tools they offer.

A machine worker runs a `Heartbeat` thread that rewrites `cmdop:machine:<name>` with a
short TTL well inside it, and deletes it on a clean stop; a killed worker's key simply
expires, so the machine reads as offline within `presence_ttl_s`. Readers (the
coordinator building the catalogue and routing calls, `cmdop-worker machines`, the
`list_machines` tool) call `online_machines`.

The names of machines that have a presence key are also kept in one small set
(`<prefix>machines`), so a reader fetches them with SMEMBERS + MGET instead of scanning
the keyspace — a scan that grew to tens of milliseconds per turn with a day's runs in
Redis. The key's TTL stays the truth: a name whose key has expired is dropped from the
set by the next reader.

A coordinator reads presence more than once a turn (the catalogue, then routing) and
the set of names rarely changes, so a reader sends SMEMBERS and the MGET of the names
it saw last in one pipeline: one round trip instead of two. Only when the set has
changed since does it MGET the names it holds now (the second round trip every read
took before). Either way the values are read after the set, as before.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import Any

import redis

from cmdop_worker.models import MachinePresence, ToolSpec
from cmdop_worker.state.keys import Keys

log = logging.getLogger(__name__)


# The names each index held when last read (benign races: a stale guess costs a MGET).
_last_names: dict[str, list[str]] = {}


def online_machines(client: redis.Redis, keys: Keys) -> list[MachinePresence]:
    """Every live machine, sorted by name; unreadable presences are left out."""
    index = keys.machines_index
    guess = _last_names.get(index)
    raws: Any = None
    if guess:
        pipe = client.pipeline(transaction=False)
        pipe.smembers(index)
        pipe.mget([keys.machine(n) for n in guess])
        members, raws = pipe.execute()
    else:
        members = client.smembers(index)
    names = sorted(str(n) for n in members)
    _last_names[index] = names
    if not names:
        return []
    if names != guess:  # the set changed (or is new here): read what it holds now
        raws = client.mget([keys.machine(n) for n in names])
    found, gone = [], []
    for name, raw in zip(names, raws, strict=True):
        if raw is None:
            gone.append(name)
            continue
        presence = parse_presence(raw, source=keys.machine(name))
        if presence is not None:
            found.append(presence)
    if gone:
        client.srem(keys.machines_index, *gone)
    return found


def parse_presence(raw: str | bytes, *, source: str) -> MachinePresence | None:
    """A presence, ignoring fields this version does not know (a newer worker may add
    some); None, with a warning, when it is unreadable. Every coordinator turn reads
    all presences, so one bad key must not stop the fleet."""
    try:
        return _parsed_presence(raw)
    except (ValueError, AttributeError) as exc:  # ValidationError is a ValueError
        log.warning("ignoring unreadable machine presence %s: %s", source, exc)
        return None


@functools.lru_cache(maxsize=1024)
def _parsed_presence(raw: str | bytes) -> MachinePresence:
    """A worker's presence stays the same JSON while it lives: parsed once (the result
    is immutable; a failure is not cached, so it is reported every time)."""
    data = json.loads(raw)
    known = {k: v for k, v in data.items() if k in MachinePresence.model_fields}
    tools = known.get("tools")
    if isinstance(tools, list):
        known["tools"] = [_known_tool_fields(t) for t in tools]
    return MachinePresence.model_validate(known)


def _known_tool_fields(spec: Any) -> Any:
    if not isinstance(spec, dict):
        return spec
    return {k: v for k, v in spec.items() if k in ToolSpec.model_fields}


class Heartbeat:
    """Keeps one machine's presence key alive until stopped."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        presence: MachinePresence,
        *,
        ttl_s: float,
        refresh_s: float,
    ) -> None:
        self._redis = client
        self._name = presence.machine
        self._index = keys.machines_index
        self._key = keys.machine(presence.machine)
        self._payload = presence.model_dump_json()
        self._ttl_ms = int(ttl_s * 1000)
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmdop-heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def beat(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self._key, self._payload, px=self._ttl_ms)
        pipe.sadd(self._index, self._name)
        pipe.execute()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        try:
            self._redis.delete(self._key)
            self._redis.srem(self._index, self._name)
        except redis.RedisError:
            log.warning("could not remove presence key %s", self._key)

    def _run(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                self.beat()
            except redis.RedisError as exc:  # Redis restarting: keep trying
                log.warning("heartbeat failed: %s", exc)
