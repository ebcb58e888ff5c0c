"""Machine presence: which machine workers are alive and what tools they offer.

Keys (`state.keys`): `machine:<name>` (the presence JSON, with a short TTL: the
contract's liveness), `machines` (the names), `machines:alive` (each name scored with
when its presence lapses, in Redis time), `machines:version` (moves on whenever the
fleet changes), `machines:seen` (every name ever seen, scored with when it was last
seen: written by the same scripts, read by `state.seen`) and `machines:changed` (the
names each change touched, scored with the version it moved to, trimmed by age;
`machines:changed:since` is the version after which it misses none).

Writers: a machine worker's `Heartbeat` (`state.heartbeat`). It announces itself once
(`presence_lua.ANNOUNCE`: the presence, its name, its lapse time, and the version moved
on), then only renews: a PEXPIRE of its key, and every third beat or so a ZADD of its
new lapse time and a SADD of its name, in one round trip; an unchanged tool list is
never written again. A SADD that finds its name gone (any machine's credentials may
write the index) moves the version on (`HEALED`), so it is back within three beats. A
renewal that finds its key gone (expired through a stall, or forgotten) announces
again; a clean stop leaves (`LEAVE`); `update` announces a changed presence (new tools
or labels).

Readers (`fleet_snapshot`; `online_machines` is its list): the coordinator once a turn,
its probes and `list_machines`, `cmdop-worker machines`, the gateway. A read is one
round trip of O(1) commands — the version, the number of names, Redis' clock and the
earliest lapse time — and answers from the presences this process read at that version.
When the version moved (a join, a leave, a change) it catches up (`_catch_up`): the
names changed since the version it holds, then those names' presences, two round trips
whatever the fleet's size. It reads every name and presence again (`_reload`) only
when it holds nothing, when the log cannot tell what changed (its version is older than
the log's horizon, the version went back, a change was not logged) or when the number
of names does not add up (a writer that moves no version, an older worker). Only when
the earliest lapse time has passed does it look at the lapsed names' keys (`_lapsed`):
a key that is gone means a dead machine, which is forgotten (`FORGET`, atomic against
its coming back) and moves the version on, so a machine killed without a word reads
offline when its key expires, as before; a key still there (a writer that renews no
lapse time) gets its lapse time from its TTL. Machines write these keys, so a reader
trusts none of it (`presence_parse`): a version that is no whole number is unknown
(everything is read, and read again next time), a refused read of the change log
means a full read, and a presence naming another machine than its key is left out.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter

import redis
from redis.client import NEVER_DECODE

from cmdop_worker.models import MachinePresence
from cmdop_worker.state.heartbeat import Heartbeat as Heartbeat
from cmdop_worker.state.heartbeat import announce as announce
from cmdop_worker.state.heartbeat import leave as leave
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.presence_lua import FORGET
from cmdop_worker.state.presence_parse import claimed, parse_presence, parse_version
from cmdop_worker.state.scripts import run_script

log = logging.getLogger(__name__)

_NAME = attrgetter("machine")
_LAPSED_AT_MOST = 512  # lapsed names looked at per read
_NO_TTL_RECHECK_MS = 10_000  # a key someone wrote with no TTL is looked at again after
# Read as bytes what machines write (names, presences, the version): a client that decodes
# would fail the read on a name that is no UTF-8, on every read (`_names` drops them).
_RAW = {NEVER_DECODE: True}


@dataclass(frozen=True)
class FleetSnapshot:
    """The live machines as read at one version of the fleet, sorted by name."""

    version: str | None
    count: int  # names in the index when read
    presences: tuple[MachinePresence, ...]
    # Every name the fleet has seen, online or not (`machines:seen`): only an announce
    # adds one, and it moves the version on, so this is as current as the presences.
    known: frozenset[str] = frozenset()
    # The names in the index (`presences` leaves out unreadable ones): what a catch-up
    # adds to and takes from, and checks against the index's count.
    names: frozenset[str] = frozenset()


# Per Redis connection pool and key prefix: the last snapshot read (benign races: a
# stale one is replaced by the next read that sees the version move).
_snapshots: dict[tuple[int, str], FleetSnapshot] = {}


def online_machines(client: redis.Redis, keys: Keys) -> list[MachinePresence]:
    """Every live machine, sorted by name; unreadable presences are left out."""
    return list(fleet_snapshot(client, keys).presences)


def fleet_snapshot(client: redis.Redis, keys: Keys) -> FleetSnapshot:
    """The live fleet: the snapshot held for its version, read again only when it moved
    or a machine's lapse time passed (the module docstring). A fleet-wide key a machine
    turned into another type (`SET` over the index) reads as an empty fleet, with a
    warning, never as a failed turn: the fleet's own scripts write them back."""
    try:
        return _fleet_snapshot(client, keys)
    except redis.ResponseError as exc:
        log.warning("the fleet's presence keys cannot be read (%s); no machine online", exc)
        _snapshots.pop((id(client.connection_pool), keys.machines_index), None)
        return FleetSnapshot(version=None, count=0, presences=())


def _fleet_snapshot(client: redis.Redis, keys: Keys) -> FleetSnapshot:
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("GET", keys.machines_version, **_RAW)
    pipe.scard(keys.machines_index)
    pipe.time()
    pipe.execute_command("ZRANGE", keys.machines_alive, 0, 0, "WITHSCORES", withscores=True, **_RAW)
    raw_version, count, (seconds, micros), earliest = pipe.execute()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    slot = (id(client.connection_pool), keys.machines_index)
    held = _snapshots.get(slot)
    version = parse_version(raw_version)  # None: unknown, so everything is read
    snapshot = None
    if held is not None and version is not None and held.version is not None:
        if held.version == version and held.count == count:
            lapsed = bool(earliest) and earliest[0][1] < now_ms
            if not (lapsed and _lapsed(client, keys, now_ms)):
                return held
            snapshot = _catch_up(client, keys, held, now_ms)  # a lapsed machine forgotten
        elif held.version != version:
            snapshot = _catch_up(client, keys, held, now_ms)
    if snapshot is None:
        snapshot = _reload(client, keys, now_ms)
    _snapshots[slot] = snapshot
    return snapshot


def _catch_up(
    client: redis.Redis, keys: Keys, held: FleetSnapshot, now_ms: int
) -> FleetSnapshot | None:
    """`held` brought up to the fleet's version by reading only the machines changed
    since its version: the change log, then their presences and index membership (each
    in one transaction). None when the log cannot tell (the module docstring): the
    caller reads everything, as it does when Redis refuses a read (keys a machine wrote
    something else into): what a machine writes must never fail a reader."""
    try:
        return _caught_up(client, keys, held, now_ms)
    except (redis.ResponseError, UnicodeDecodeError) as exc:
        log.warning("reading the whole fleet again: its change log is unreadable: %s", exc)
        return None


def _caught_up(
    client: redis.Redis, keys: Keys, held: FleetSnapshot, now_ms: int
) -> FleetSnapshot | None:
    assert held.version is not None
    pipe = client.pipeline(transaction=True)
    pipe.get(keys.machines_version)
    pipe.get(keys.machines_changed_since)
    pipe.zrangebyscore(keys.machines_changed, f"({held.version}", "+inf")
    raw_version, raw_since, changed = pipe.execute()
    version, since = parse_version(raw_version), parse_version(raw_since)
    if version is None or since is None or not changed:
        return None  # no log (Redis lost it), or a change that was not logged
    if int(held.version) < int(since) or int(version) < int(held.version):
        return None  # older than the log's horizon, or the version went back (a restore)
    names = sorted(_text(n) or "" for n in changed)
    pipe = client.pipeline(transaction=True)
    pipe.get(keys.machines_version)
    pipe.scard(keys.machines_index)
    pipe.mget([keys.machine(n) for n in names])
    pipe.zmscore(keys.machines_alive, names)
    pipe.smismember(keys.machines_index, names)
    version_now, count, raws, scores, members = pipe.execute()
    touched = set(names)
    listed = [name for name, member in zip(names, members, strict=True) if member]
    in_index = (held.names - touched) | frozenset(listed)
    if parse_version(version_now) == version and len(in_index) != count:
        return None  # the names do not add up: a writer that logs no change
    read = zip(names, raws, scores, members, strict=True)
    rows = [(name, raw, score) for name, raw, score, member in read if member]
    found = _presences(client, keys, rows, now_ms)
    known = held.known if touched <= held.known else held.known | touched
    return FleetSnapshot(
        version, len(in_index), _merged(held.presences, touched, found), known, in_index
    )


def _merged(
    held: tuple[MachinePresence, ...], touched: set[str], found: list[MachinePresence]
) -> tuple[MachinePresence, ...]:
    """`held` (sorted by name) without the touched names, with `found` in its place:
    by bisection while few changed, so a join costs little more than a copy."""
    if len(touched) > 64:
        kept = [p for p in held if p.machine not in touched]
        return tuple(sorted([*kept, *found], key=_NAME))
    merged = list(held)
    for name in touched:
        at = bisect.bisect_left(merged, name, key=_NAME)
        if at < len(merged) and merged[at].machine == name:
            del merged[at]
    for presence in found:
        bisect.insort(merged, presence, key=_NAME)
    return tuple(merged)


def _reload(client: redis.Redis, keys: Keys, now_ms: int) -> FleetSnapshot:
    """Every name and presence, read afresh, tagged with the version read before them
    (a change after it moves the version again, so the snapshot is never taken for
    newer than it is)."""
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("GET", keys.machines_version, **_RAW)
    pipe.scard(keys.machines_index)
    pipe.execute_command("SMEMBERS", keys.machines_index, **_RAW)
    pipe.execute_command("ZRANGE", keys.machines_seen, 0, -1, **_RAW)
    raw_version, count, members, seen = pipe.execute()
    names = sorted(_names(members))
    known = frozenset(_names(seen))
    if not names:
        return FleetSnapshot(parse_version(raw_version), count, (), known, frozenset())
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("MGET", *[keys.machine(n) for n in names], **_RAW)
    pipe.zmscore(keys.machines_alive, names)
    raws, scores = pipe.execute()
    found = _presences(client, keys, list(zip(names, raws, scores, strict=True)), now_ms)
    return FleetSnapshot(parse_version(raw_version), count, tuple(found), known, frozenset(names))


def _presences(
    client: redis.Redis,
    keys: Keys,
    rows: list[tuple[str, str | bytes | None, float | None]],
    now_ms: int,
) -> list[MachinePresence]:
    """The readable presences of indexed names read as (name, presence, lapse time), in
    their order. A name whose key is gone is forgotten; one with no lapse time (written
    by something that keeps none) gets one now, to be looked at soon; a presence naming
    another machine than its key is left out (`claimed`)."""
    found, gone, unscored = [], [], {}
    for name, raw, score in rows:
        if raw is None:
            gone.append(name)
            continue
        if score is None:
            unscored[name] = now_ms
        source = keys.machine(name)
        presence = parse_presence(raw, source=source)
        if claimed(presence, name, source=source):
            found.append(presence)
    if unscored:
        client.zadd(keys.machines_alive, unscored, nx=True)
    if gone:
        _forget(client, keys, gone)
    return found


def _lapsed(client: redis.Redis, keys: Keys, now_ms: int) -> bool:
    """Look at the machines whose lapse time has passed: True when one of them is gone
    (and now forgotten); those still there get their lapse time from their key's TTL."""
    due = client.execute_command(
        "ZRANGEBYSCORE",
        keys.machines_alive,
        "-inf",
        f"({now_ms}",
        "LIMIT",
        0,
        _LAPSED_AT_MOST,
        **_RAW,
    )
    names = _names(due)
    if not names:
        return False
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.pttl(keys.machine(name))
    ttls = pipe.execute()
    gone = [name for name, ttl_ms in zip(names, ttls, strict=True) if ttl_ms == -2]
    still = {
        name: now_ms + (ttl_ms if ttl_ms >= 0 else _NO_TTL_RECHECK_MS)
        for name, ttl_ms in zip(names, ttls, strict=True)
        if ttl_ms != -2
    }
    if still:
        client.zadd(keys.machines_alive, still, xx=True, gt=True)
    return bool(gone) and _forget(client, keys, gone) > 0


def _forget(client: redis.Redis, keys: Keys, names: list[str]) -> int:
    """Drop machines whose key is gone from the index and the lapse times (one that came
    back meanwhile is kept); the version moves on when any was dropped."""
    return int(
        run_script(
            client,
            FORGET,
            keys={
                "index_key": keys.machines_index,
                "alive_key": keys.machines_alive,
                "version_key": keys.machines_version,
                "seen_key": keys.machines_seen,
                "changed_key": keys.machines_changed,
                "since_key": keys.machines_changed_since,
            },
            args={},
            more_keys=[keys.machine(n) for n in names],
            more_args=names,
        )
    )


def _names(raw: Iterable[str | bytes]) -> list[str]:
    """Names as read raw: one that is no UTF-8 is no machine's (a machine's credentials
    may add anything to these sets) and is left out."""
    names = []
    for name in raw:
        try:
            names.append(name.decode() if isinstance(name, bytes) else name)
        except UnicodeDecodeError:
            continue
    return names


def _text(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
