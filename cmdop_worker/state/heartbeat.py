"""The writer's side of presence (`presence`'s docstring): a machine worker announcing
itself, renewing its presence (`Heartbeat`) and leaving, through `presence_lua`'s scripts.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from cmdop_worker.models import MachinePresence
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.outage import OUTAGE
from cmdop_worker.state.presence_lua import ANNOUNCE, HEALED, LEAVE
from cmdop_worker.state.scripts import run_script

log = logging.getLogger(__name__)


def announce(client: redis.Redis, keys: Keys, presence: MachinePresence, *, ttl_ms: int) -> int:
    """Write a machine's presence as its worker does when it starts (or its presence
    changed, or lapsed): the fleet's version moves on. Returns Redis' time in ms."""
    return int(
        run_script(
            client,
            ANNOUNCE,
            keys=_machine_keys(keys, presence.machine),
            args={
                "machine": presence.machine,
                "payload": presence.model_dump_json(),
                "ttl_ms": ttl_ms,
            },
        )
    )


def leave(client: redis.Redis, keys: Keys, machine: str) -> None:
    """Remove a machine's presence as its worker does on a clean stop: the version
    moves on."""
    run_script(client, LEAVE, keys=_machine_keys(keys, machine), args={"machine": machine})


def _machine_keys(keys: Keys, machine: str) -> dict[str, str]:
    return {
        "presence_key": keys.machine(machine),
        "index_key": keys.machines_index,
        "alive_key": keys.machines_alive,
        "version_key": keys.machines_version,
        "seen_key": keys.machines_seen,
        "changed_key": keys.machines_changed,
        "since_key": keys.machines_changed_since,
    }


class Heartbeat:
    """Keeps one machine's presence alive until stopped: announced once, then renewed
    (the module docstring)."""

    _REANCHOR_S = 60.0  # how often a renewal reads Redis' clock again

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
        self._keys = keys
        self._presence = presence
        self._ttl_ms = int(ttl_s * 1000)
        self._refresh_ms = int(refresh_s * 1000)
        self._refresh_s = refresh_s
        self._anchor = (0, 0.0)  # (Redis time in ms, time.monotonic()) when last read
        self._lapses_ms = 0  # the lapse time last written, in Redis time
        self._unindexed = 2  # beats since the name was last put in the index
        # The lapse time is written again once it is this near (ms): every third beat
        # with the defaults (5 s, 1.5 s), half a beat or more before it passes; never
        # sooner than two beats before (a reader that finds it passed reads the TTL).
        self._rescore_ms = min(
            2 * self._refresh_ms,
            max(self._ttl_ms - 5 * self._refresh_ms // 2, self._refresh_ms // 2),
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmdop-heartbeat", daemon=True)

    def start(self) -> None:
        self._announce()
        self._thread.start()

    def update(self, presence: MachinePresence) -> None:
        """A changed presence (its tools or labels): written, and the version moved on."""
        self._presence = presence
        self._announce()

    def beat(self) -> None:
        """Renew: the key's TTL; the lapse time once it is near (`_rescore_ms`), and then
        (or at least every third beat) the name in the index, put back when someone
        removed it (`_healed`): an idle worker's commands stay few."""
        now_ms = self._redis_now_ms()
        machine = self._presence.machine
        pipe = self._redis.pipeline(transaction=False)
        pipe.pexpire(self._keys.machine(machine), self._ttl_ms)
        lapses_ms = now_ms + self._ttl_ms
        scored = self._lapses_ms - now_ms < self._rescore_ms
        if scored:
            pipe.zadd(self._keys.machines_alive, {machine: lapses_ms})
        indexed = scored or self._unindexed >= 2
        if indexed:
            pipe.sadd(self._keys.machines_index, machine)
        self._unindexed = 0 if indexed else self._unindexed + 1
        reanchor = time.monotonic() - self._anchor[1] > self._REANCHOR_S
        if reanchor:
            pipe.time()
        replies = pipe.execute()
        if not replies[0]:  # the key is gone: announce again
            self._announce()
            return
        if scored:
            self._lapses_ms = lapses_ms
        if indexed and replies[1 + scored]:
            self._healed()
        if reanchor:
            seconds, micros = replies[-1]
            self._anchor = (int(seconds) * 1000 + int(micros) // 1000, time.monotonic())

    def _healed(self) -> None:
        """The name was missing from the index (anyone with a machine's credentials may
        remove it) and the renewal put it back: the version moves on, so readers see
        this machine again within a beat or two."""
        log.warning(
            "machine %s was missing from the fleet's index: put back", self._presence.machine
        )
        run_script(
            self._redis,
            HEALED,
            keys=_machine_keys(self._keys, self._presence.machine),
            args={"machine": self._presence.machine, "ttl_ms": self._ttl_ms},
        )

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        machine = self._presence.machine
        try:
            leave(self._redis, self._keys, machine)
        except redis.RedisError:
            log.warning("could not remove presence key %s", self._keys.machine(machine))

    def _announce(self) -> None:
        now_ms = announce(self._redis, self._keys, self._presence, ttl_ms=self._ttl_ms)
        self._anchor = (now_ms, time.monotonic())
        self._lapses_ms = now_ms + self._ttl_ms

    def _redis_now_ms(self) -> int:
        redis_ms, at = self._anchor
        return redis_ms + int((time.monotonic() - at) * 1000)

    def _run(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                self.beat()
                OUTAGE.reached()
            except redis.RedisError as exc:  # Redis restarting: keep trying, quietly
                OUTAGE.failed("heartbeat", exc)
