"""Cancel delivery inside a worker process: one pub/sub listener, many watchers.

A `CancelHub` runs one thread per process, pattern-subscribed to every run's control
channel. Work that must stop at once on a ui cancel — a model stream, a running tool —
holds a `CancelWatch` for its run: the hub sets the watch's event when a cancel arrives
that must be honoured now (channel `ui`, or any cancel once the run's deadline has
passed), and runs the watch's callbacks (e.g. closing an HTTP stream). Entering a watch
also reads the cancel key (or its holder does, right after, in a script of its own), so
a cancel sent just before the watch began is not missed;
after a lost connection the hub re-reads the keys of every run it watches.

A pushed message is a prompt to read the run's cancel key, never a request in itself:
whoever may publish on a control channel but not write cancel keys cancels nothing.

Operation cancels are not pushed into running work: they are read from the cancel key
at the next loop boundary, which is what "respects deadlines" means.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import redis
from pydantic import ValidationError

from cmdop_worker.models import CancelRequest
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.outage import OUTAGE
from cmdop_worker.state.store import RunStore

log = logging.getLogger(__name__)

Listener = Callable[[str, CancelRequest], None]


def must_stop_now(cancel: CancelRequest | None, *, now_ms: int, deadline_ms: int) -> bool:
    return cancel is not None and (cancel.channel == "ui" or now_ms >= deadline_ms)


class CancelWatch:
    def __init__(self, hub: CancelHub, run_id: str, deadline_ms: int, *, read_now: bool) -> None:
        self.hub = hub
        self.read_now = read_now
        self.run_id = run_id
        self.deadline_ms = deadline_ms
        self.event = threading.Event()
        self.request: CancelRequest | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        with self._lock:
            fire_now = self.event.is_set()
            if not fire_now:
                self._callbacks.append(callback)
        if fire_now:
            callback()

    def offer(self, cancel: CancelRequest | None) -> None:
        if not must_stop_now(cancel, now_ms=self.hub.clock_ms(), deadline_ms=self.deadline_ms):
            return
        with self._lock:
            if self.event.is_set():
                return
            self.request = cancel
            self.event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a callback closing a stream may race its owner
                log.debug("cancel callback failed", exc_info=True)

    @property
    def cancelled(self) -> bool:
        return self.event.is_set()

    def __enter__(self) -> CancelWatch:
        self.hub._add(self)
        if self.read_now:
            self.offer(self.hub.store.cancel_request(self.run_id))
        return self

    def __exit__(self, *exc: object) -> None:
        self.hub._remove(self)


class CancelHub:
    def __init__(
        self,
        client: redis.Redis,
        store: RunStore,
        keys: Keys,
        *,
        clock_ms: Callable[[], int],
    ) -> None:
        self.client = client
        self.store = store
        self.keys = keys
        self.clock_ms = clock_ms
        self._watches: dict[str, set[CancelWatch]] = defaultdict(set)
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmdop-cancel-hub", daemon=True)

    def start(self, timeout_s: float = 5.0) -> None:
        self._thread.start()
        self._ready.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def watch(self, run_id: str, deadline_ms: int, *, read_now: bool = True) -> CancelWatch:
        """A watch on `run_id` for a `with` block. Entering it reads the cancel key,
        unless `read_now` is False: the caller reads it itself after entering (in a
        script that must see it atomically) and offers what it found."""
        return CancelWatch(self, run_id, deadline_ms, read_now=read_now)

    def _add(self, watch: CancelWatch) -> None:
        with self._lock:
            self._watches[watch.run_id].add(watch)

    def _remove(self, watch: CancelWatch) -> None:
        with self._lock:
            group = self._watches.get(watch.run_id)
            if group is not None:
                group.discard(watch)
                if not group:
                    del self._watches[watch.run_id]

    def deliver(self, run_id: str, cancel: CancelRequest) -> None:
        with self._lock:
            watches = list(self._watches.get(run_id, ()))
        for watch in watches:
            watch.offer(cancel)
        for listener in self._listeners:
            try:
                listener(run_id, cancel)
            except Exception:
                log.exception("cancel listener failed for run %s", run_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                OUTAGE.failed("cancel hub", exc)
                self._stop.wait(0.5)

    def _listen(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.psubscribe(self.keys.control_pattern)
            OUTAGE.reached()
            self._ready.set()
            self._recheck_watched()
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=0.5)
                if message is not None:
                    self._handle(message)
        finally:
            pubsub.close()

    def _handle(self, message: dict[str, Any]) -> None:
        channel = _text(message.get("channel", ""))
        try:
            CancelRequest.model_validate_json(message["data"])
        except (ValidationError, KeyError, TypeError):
            log.warning("ignoring malformed cancel request on %s", channel)
            return
        # The message only says "look": the request acted on is the one in the cancel
        # key, which the same script wrote first. A client that may publish here but not
        # write that key (a machine's ACL user) cancels nothing.
        run_id = self.keys.run_id_from_control(channel)
        cancel = self.store.cancel_request(run_id)
        if cancel is None:
            log.warning("ignoring a cancel pushed for run %s with no cancel request", run_id)
            return
        self.deliver(run_id, cancel)

    def _recheck_watched(self) -> None:
        with self._lock:
            run_ids = list(self._watches)
        for run_id in run_ids:
            cancel = self.store.cancel_request(run_id)
            if cancel is not None:
                self.deliver(run_id, cancel)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
