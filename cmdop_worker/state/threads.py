"""Threads: conversations of many runs, each starting from the history the last one left.

Who calls it: `coordinator.runs.start_run` claims the thread for a new run
(`ThreadStore.claim`), `coordinator.finish` hands it back when the run ends
(`release`); clients list, show and delete threads.

A thread is busy while its `active` run has not written its terminal event. What a
request does with a busy thread is its `on_busy`, decided in the claim script, so two
requests racing on one thread see one order:

- `reject`: refused (`BUSY`), nothing is stored;
- `enqueue`: the request waits in the thread's queue (`QUEUED`); the run that ends
  hands the thread to the queue's head, which starts as soon as its `cmdop.run` task is
  delivered again (`release` returns it for that);
- `interrupt`: the request goes to the head of the queue (`INTERRUPTS`) and the caller
  ui-cancels the active run;
- `steer`: the text is appended to the active run's steer list (`STEERED`), which the
  run reads at its next loop boundary. With nothing running, `steer` starts a run.

A free thread with requests still queued belongs to its queue: only the head may claim
it, and any other request finds it busy. The head itself (a release whose new task
was lost) is returned as `kick` by every such refused claim, so its start is sent again.

Expiry: every key of a thread lives `ttl_s` from its last use (`CMDOP_THREAD_TTL_S`);
the index `<p>threads` (score = last use) is pruned of expired ones when listed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

import redis

from cmdop_worker.errors import LeaseLost, ThreadBusy
from cmdop_worker.models import Message
from cmdop_worker.state.fence import write_fence
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.scripts import run_script
from cmdop_worker.state.threads_lua import CLAIM_LUA, DROP_LUA, RELEASE_LUA
from cmdop_worker.state.threads_lua import STARTING_GRACE_MS as STARTING_GRACE_MS


class Claim(Enum):
    STARTED = "started"  # the run owns the thread: start it from `history`
    EXISTS = "exists"  # the run was started before (a redelivery): nothing changed
    QUEUED = "queued"  # it waits for the thread (enqueue)
    INTERRUPTS = "interrupts"  # it is next; the caller ui-cancels `active`
    STEERED = "steered"  # its text went to the running run `active`
    BUSY = "busy"  # refused (reject)


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    history: list[Message]
    active: str | None = None  # the run the thread is busy with
    kick: dict[str, Any] | None = None  # a queued request whose start must be sent again


@dataclass(frozen=True)
class ThreadInfo:
    thread_id: str
    last_used_ms: int
    runs: list[str]
    active: str | None
    queued: int


class ThreadStore:
    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s

    def _keys(self, thread_id: str) -> dict[str, str]:
        parts = ("active", "queue", "runs", "history")
        return {
            **{part: self.keys.thread(thread_id, part) for part in parts},
            "index": self.keys.threads_index,
        }

    def claim(
        self, thread_id: str, run_id: str, on_busy: str, request: dict[str, Any], *, now_ms: int
    ) -> ClaimResult:
        """Take the thread for `run_id`, or do with the request what `on_busy` says."""
        steer_text = request.get("prompt") or _messages_text(request.get("messages") or [])
        outcome, detail, kick = run_script(
            self.redis,
            CLAIM_LUA,
            keys=self._keys(thread_id),
            args={
                "run_id": run_id,
                "on_busy": on_busy,
                "request": json.dumps(request, separators=(",", ":")),
                "steer_text": steer_text,
                "ttl_s": self.ttl_s,
                "now_ms": now_ms,
                "key_prefix": self.keys.prefix,
                "thread_id": thread_id,
            },
        )
        claim = Claim(_text(outcome))
        kicked = json.loads(kick) if kick else None
        if claim is Claim.STARTED:
            history = [Message.model_validate(m) for m in json.loads(detail)]
            return ClaimResult(claim, history, kick=kicked)
        return ClaimResult(claim, [], active=_text(detail) or None, kick=kicked)

    def release(
        self,
        thread_id: str,
        run_id: str,
        history: list[Message],
        *,
        now_ms: int,
        follow_up: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Store the ending run's history as the thread's and free the thread, putting
        `follow_up` first in its queue; returns the queued request to start next, if any.
        Inside a turn executor's fence, raises `LeaseLost` having done nothing when the
        executor no longer holds its turn."""
        fence = write_fence(
            run_id,
            unfenced_lock=self.keys.thread(thread_id, "active"),
            refused="the thread is kept",
        )
        head = run_script(
            self.redis,
            RELEASE_LUA,
            keys={**self._keys(thread_id), **fence.keys},
            args={
                "run_id": run_id,
                "history": json.dumps(
                    [m.model_dump(mode="json") for m in history], separators=(",", ":")
                ),
                "ttl_s": self.ttl_s,
                "now_ms": now_ms,
                "thread_id": thread_id,
                **fence.args,
                "follow_up": json.dumps(follow_up, separators=(",", ":")) if follow_up else "",
            },
        )
        if head == -1:
            raise LeaseLost(f"run {run_id}: lost its turn's lease; the thread is kept")
        return json.loads(head) if head else None

    def drop_queued(self, thread_id: str, run_id: str) -> dict[str, Any] | None:
        """Take a waiting request that can never start out of the queue (so it does not
        hold the thread forever); returns the new head, to be started next."""
        head = run_script(
            self.redis,
            DROP_LUA,
            keys={"queue": self.keys.thread(thread_id, "queue")},
            args={"run_id": run_id},
        )
        return json.loads(head) if head else None

    def steers(self, run_id: str, *, after: int) -> list[str]:
        """The messages steering `run_id` from the `after`-th on (0: all)."""
        raw = cast(list[Any], self.redis.lrange(self.keys.steer(run_id), after, -1))
        return [json.loads(item)["text"] for item in raw]

    def steer_count(self, run_id: str) -> int:
        return int(cast(int, self.redis.llen(self.keys.steer(run_id))))

    # -- what clients see -----------------------------------------------------------

    def all(self, *, now_ms: int) -> list[ThreadInfo]:
        """Every live thread, most recently used first."""
        self.redis.zremrangebyscore(self.keys.threads_index, "-inf", now_ms - self.ttl_s * 1000)
        ids = cast(list[Any], self.redis.zrevrange(self.keys.threads_index, 0, -1))
        infos = [self.info(_text(thread_id)) for thread_id in ids]
        return [info for info in infos if info is not None]

    def info(self, thread_id: str) -> ThreadInfo | None:
        keys = self._keys(thread_id)
        active_key, queue_key, runs_key, index = (
            keys["active"],
            keys["queue"],
            keys["runs"],
            keys["index"],
        )
        pipe = self.redis.pipeline(transaction=False)
        pipe.zscore(index, thread_id)
        pipe.lrange(runs_key, 0, -1)
        pipe.get(active_key)
        pipe.llen(queue_key)
        score, runs, active, queued = pipe.execute()
        if score is None or not (runs or active or queued):
            return None
        return ThreadInfo(
            thread_id=thread_id,
            last_used_ms=int(score),
            runs=[_text(r) for r in runs],
            active=_text(active).split(" ")[0] if active else None,
            queued=int(queued),
        )

    def history(self, thread_id: str) -> list[Message]:
        raw = self.redis.get(self.keys.thread(thread_id, "history"))
        return [Message.model_validate(m) for m in json.loads(raw)] if raw else []

    def delete(self, thread_id: str) -> bool:
        """Forget a thread; False when there was none. Refused (`ThreadBusy`) while a
        run is going on it or requests wait for it: they would be stranded."""
        info = self.info(thread_id)
        if info is not None and (info.active or info.queued):
            busy = f"run {info.active} is going on it" if info.active else ""
            waiting = f"{info.queued} request(s) wait for it" if info.queued else ""
            why = " and ".join(part for part in (busy, waiting) if part)
            raise ThreadBusy(f"thread {thread_id}: {why}; cancel them first")
        keys = self._keys(thread_id)
        index = keys.pop("index")
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(*keys.values())
        pipe.zrem(index, thread_id)
        deleted, removed = pipe.execute()
        return bool(deleted or removed)


def _messages_text(messages: list[Any]) -> str:
    """The text a steering request carries when it came as `messages`."""
    texts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(b.get("text", "") for b in content if isinstance(b, dict))
    return "\n\n".join(t for t in texts if t)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
