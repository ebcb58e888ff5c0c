"""The machines the fleet has seen: every name, online or not, with when it was last seen.

Key (`state.keys`): `machines:seen`, a sorted set of names scored with the Redis time
(ms) each was last seen. Presence's scripts write it (`presence_lua`): a machine
announcing itself stamps it, so does a clean leave, and a reader forgetting a machine
whose presence lapsed stamps the lapse time. It never expires: a name once seen stays
known (`ZREM` removes one for good). A name that is online without a stamp (a worker
from before it was kept) counts as known all the same.

Readers: `Client.submit`, so the CLI and the gateway too (`submit_warnings`: is a
request's machine known, and online?), and `cmdop-worker machines --all`
(`known_machines`). What to say about an unknown or offline name is
`core.machine_names`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import redis
from redis.client import NEVER_DECODE

from cmdop_worker.core.machine_names import PERSON_HINT, offline_warning, unknown_machine
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import MachinePresence
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.presence import online_machines

Standing = Literal["online", "offline", "unknown"]


@dataclass(frozen=True)
class MachineStanding:
    """One name as the fleet knows it now; `said` is what to tell whoever named it
    (empty when online)."""

    machine: str
    standing: Standing
    last_seen_ms: int | None
    said: str


@dataclass(frozen=True)
class KnownMachine:
    """A name the fleet has seen: its live presence when online."""

    machine: str
    last_seen_ms: int | None  # None: online, from before last-seen times were kept
    presence: MachinePresence | None

    @property
    def online(self) -> bool:
        return self.presence is not None


def standing(client: redis.Redis, keys: Keys, machine: str) -> MachineStanding:
    """Whether `machine` is online, known but offline, or never seen: one round trip,
    and one more to find the closest known names when it was never seen."""
    pipe = client.pipeline(transaction=False)
    pipe.exists(keys.machine(machine))
    pipe.zscore(keys.machines_seen, machine)
    pipe.zscore(keys.machines_alive, machine)
    pipe.time()
    live, seen, alive, (seconds, micros) = pipe.execute()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    if live:
        return MachineStanding(machine, "online", now_ms, "")
    if seen is not None or alive is not None:
        last_ms = _last_seen(seen, alive, now_ms)
        return MachineStanding(
            machine, "offline", last_ms, offline_warning(machine, last_ms, now_ms)
        )
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("ZRANGE", keys.machines_seen, 0, -1, **_RAW)
    pipe.execute_command("SMEMBERS", keys.machines_index, **_RAW)
    seen_names, online_names = pipe.execute()
    online = _decoded(online_names)
    known = _decoded(seen_names) | online
    said = unknown_machine(machine, known, online, hint=PERSON_HINT)
    return MachineStanding(machine, "unknown", None, said)


def submit_warnings(client: redis.Redis, keys: Keys, machine: str | None) -> tuple[str, ...]:
    """What a request naming `machine` is told at submit: nothing when it is online, a
    warning when it is known but offline; `InvalidRequest` when the fleet never saw it."""
    if machine is None:
        return ()
    found = standing(client, keys, machine)
    if found.standing == "unknown":
        raise InvalidRequest(f"machine: {found.said}")
    return (found.said,) if found.standing == "offline" else ()


def seen_names(client: redis.Redis, keys: Keys) -> set[str]:
    """The name of every machine this fleet has seen (one read of the seen set)."""
    return _decoded(client.execute_command("ZRANGE", keys.machines_seen, 0, -1, **_RAW))


def known_machines(client: redis.Redis, keys: Keys) -> list[KnownMachine]:
    """Every machine the fleet has seen, by name: those online with their presence,
    the others with when they were last seen."""
    online = {p.machine: p for p in online_machines(client, keys)}
    pipe = client.pipeline(transaction=False)
    for key in (keys.machines_seen, keys.machines_alive):
        pipe.execute_command("ZRANGE", key, 0, -1, "WITHSCORES", withscores=True, **_RAW)
    pipe.time()
    seen_rows, alive_rows, (seconds, micros) = pipe.execute()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    seen = {n: score for n, score in _decoded_rows(seen_rows)}
    alive = {n: score for n, score in _decoded_rows(alive_rows)}
    names = sorted(seen.keys() | online.keys())
    return [
        KnownMachine(
            name,
            now_ms if name in online else _last_seen(seen.get(name), alive.get(name), now_ms),
            online.get(name),
        )
        for name in names
    ]


def _last_seen(seen: float | None, alive: float | None, now_ms: int) -> int | None:
    """The latest of its stamp and its presence's lapse time (when no reader has yet
    forgotten it), never later than now."""
    times = [int(t) for t in (seen, alive) if t is not None]
    return min(max(times), now_ms) if times else None


# Read raw: these sets are written by machines, whose credentials may add a name that
# is no UTF-8 (no machine's); decoding it would fail every reader.
_RAW = {NEVER_DECODE: True}


def _decoded(names: Any) -> set[str]:
    return {n for n in (_utf8(name) for name in names) if n is not None}


def _decoded_rows(rows: Any) -> list[tuple[str, float]]:
    return [(n, score) for n, score in ((_utf8(name), score) for name, score in rows) if n]


def _utf8(name: str | bytes) -> str | None:
    try:
        return name.decode() if isinstance(name, bytes) else name
    except UnicodeDecodeError:
        return None
