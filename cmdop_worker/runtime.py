"""One worker process's connections and services, built once from `Settings`.

Tasks reach everything effectful through `Runtime`: the Redis client, the run store,
the event sink, the cancel hub, the model client, and (on a machine worker) the tool
registry and permission policy. `current()` builds it lazily on first use in each
process; `configure()` lets an entry point (the worker command, a test) supply the
settings first.
"""

from __future__ import annotations

import getpass
import os
import platform
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import redis

from cmdop_worker.cancel import CancelHub
from cmdop_worker.config import AgentProfile, Settings
from cmdop_worker.core.context import HostFacts
from cmdop_worker.events import EventSink
from cmdop_worker.keys import Keys
from cmdop_worker.store import RunStore

if TYPE_CHECKING:
    from cmdop_worker.llm import ModelClient


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def redis_client(url: str, *, blocking: bool = False) -> redis.Redis:
    """A client for state and events. `blocking` clients wait as long as a read needs
    (XREAD BLOCK, pub/sub); others fail fast and retry through a Redis restart."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=None if blocking else 10,
        socket_connect_timeout=5,
        health_check_interval=15,
        retry_on_timeout=True,
    )


def host_facts(settings: Settings) -> HostFacts:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return HostFacts(
        hostname=settings.hostname or socket.gethostname(),
        os_name=f"{platform.system()} {platform.release()}",
        timezone=time.strftime("%Z") or "UTC",
        user=user,
    )


@dataclass
class Runtime:
    settings: Settings
    redis: redis.Redis = field(init=False)
    keys: Keys = field(init=False)
    store: RunStore = field(init=False)
    events: EventSink = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.redis = redis_client(s.redis_url)
        self.keys = Keys(s.key_prefix)
        self.store = RunStore(self.redis, self.keys, ttl_s=s.run_ttl_s)
        self.events = EventSink(
            self.redis, self.keys, maxlen=s.event_stream_maxlen, ttl_s=s.run_ttl_s, clock_ms=now_ms
        )
        self._hub_lock = threading.Lock()
        self._hub: CancelHub | None = None

    @property
    def hub(self) -> CancelHub:
        with self._hub_lock:
            if self._hub is None:
                blocking = redis_client(self.settings.redis_url, blocking=True)
                self._hub = CancelHub(blocking, self.store, self.keys, clock_ms=now_ms)
                self._hub.start()
            return self._hub

    @cached_property
    def model(self) -> ModelClient:
        from cmdop_worker.llm import AnthropicModel

        return AnthropicModel(self.settings)

    @cached_property
    def agents(self) -> dict[str, AgentProfile]:
        return self.settings.load_agents()

    @cached_property
    def hide_map(self) -> dict[str, frozenset[str]]:
        return self.settings.load_hide_map()

    @cached_property
    def host(self) -> HostFacts:
        return host_facts(self.settings)

    def close(self) -> None:
        if self._hub is not None:
            self._hub.stop()
        self.redis.close()


_lock = threading.Lock()
_current: Runtime | None = None


def configure(settings: Settings) -> Runtime:
    global _current
    with _lock:
        _current = Runtime(settings)
        return _current


def current() -> Runtime:
    global _current
    with _lock:
        if _current is None:
            _current = Runtime(Settings.from_env())
        return _current
