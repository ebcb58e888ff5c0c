"""One worker process's connections and services, built once from `Settings`.

Tasks reach everything effectful through `Runtime`: the Redis client, the run and
thread stores, the event sink, the cancel hub, and the services a wing builds once per
process on top of them (`service`: the coordinator's model client, for one). `current()` builds it
lazily on first use in each process; `configure()` lets an entry point (the worker
command, a test) supply the settings first.
"""

from __future__ import annotations

import getpass
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from cmdop_worker.config import AgentProfile, Settings
from cmdop_worker.core.context import HostFacts
from cmdop_worker.state.cancel import CancelHub
from cmdop_worker.state.connect import Redis, now_ms, redis_client
from cmdop_worker.state.events import EventSink
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.store import RunStore
from cmdop_worker.state.threads import ThreadStore

T = TypeVar("T")


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
    redis: Redis = field(init=False)
    keys: Keys = field(init=False)
    store: RunStore = field(init=False)
    events: EventSink = field(init=False)
    threads: ThreadStore = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.redis = redis_client(s.redis_url, name=self.client_name)
        self.keys = Keys(s.key_prefix)
        self.store = RunStore(self.redis, self.keys, ttl_s=s.run_ttl_s)
        self.threads = ThreadStore(self.redis, self.keys, ttl_s=s.thread_ttl_s)
        self.events = EventSink(
            self.redis, self.keys, maxlen=s.event_stream_maxlen, ttl_s=s.run_ttl_s, clock_ms=now_ms
        )
        self._hub_lock = threading.Lock()
        self._hub: CancelHub | None = None
        self._services: dict[str, Any] = {}
        self._services_lock = threading.Lock()

    @property
    def client_name(self) -> str:
        """What this process's Redis connections are called (`CLIENT LIST`)."""
        return "cmdop-machine" if self.settings.machine is not None else "cmdop-coordinator"

    @property
    def hub(self) -> CancelHub:
        with self._hub_lock:
            if self._hub is None:
                blocking = redis_client(
                    self.settings.redis_url, blocking=True, name=self.client_name
                )
                self._hub = CancelHub(blocking, self.store, self.keys, clock_ms=now_ms)
                self._hub.start()
            return self._hub

    def service(self, name: str, build: Callable[[Settings], T]) -> T:
        """The process's `name` service, built from the settings on first use."""
        with self._services_lock:
            if name not in self._services:
                self._services[name] = build(self.settings)
            return self._services[name]  # type: ignore[no-any-return]

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
        for service in self._services.values():
            if hasattr(service, "close"):
                service.close()
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
