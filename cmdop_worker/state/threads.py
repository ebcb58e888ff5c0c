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
from cmdop_worker.state.fence import active_fence
from cmdop_worker.state.keys import Keys

# A run that claimed its thread stores its state a moment later; a claim whose run has
# neither state nor ending after this long (its starter died) no longer holds the thread.
STARTING_GRACE_MS = 60_000

# KEYS: active, queue, runs, history, index. ARGV: run_id, on_busy, request JSON, steer
# text, ttl, now, key prefix, thread id. Returns {outcome, detail, kick}: detail is the
# history JSON (started), the active run id (steered, busy, interrupts, queued); kick is
# the queue head to start again ('' for none). A run that already exists (a redelivered
# `cmdop.run`) changes nothing: 'exists'.
_CLAIM_LUA = """
local prefix = ARGV[7]
if redis.call('EXISTS', prefix .. 'run:' .. ARGV[1] .. ':state') == 1 then
  return {'exists', '', ''}
end
local function running(entry)
  if not entry then return false end
  local id, since = string.match(entry, '^(%S+) (%d+)$')
  if not id then return false end
  if redis.call('EXISTS', prefix .. 'run:' .. id .. ':terminal') == 1 then return false end
  if redis.call('EXISTS', prefix .. 'run:' .. id .. ':state') == 1 then return id end
  if tonumber(ARGV[6]) - tonumber(since) < STARTING_GRACE then return id end
  return false
end
local function touch()
  for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
  redis.call('ZADD', KEYS[5], ARGV[6], ARGV[8])
end
local active_entry = redis.call('GET', KEYS[1])
local active = running(active_entry)
if active == ARGV[1] then touch() return {'started', redis.call('GET', KEYS[4]) or '[]', ''} end
local head = redis.call('LINDEX', KEYS[2], 0)
local head_id = head and cjson.decode(head)['run_id'] or nil
if not active and (not head or head_id == ARGV[1]) then
  if head then redis.call('LPOP', KEYS[2]) end
  redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[6])
  redis.call('RPUSH', KEYS[3], ARGV[1])
  touch()
  return {'started', redis.call('GET', KEYS[4]) or '[]', ''}
end
local kick = (not active and head) or ''
local busy_with = active or head_id
if ARGV[2] == 'steer' and active and ARGV[4] ~= '' then
  local steer = prefix .. 'run:' .. active .. ':steer'
  for _, entry in ipairs(redis.call('LRANGE', steer, 0, -1)) do
    if cjson.decode(entry)['id'] == ARGV[1] then return {'steered', active, kick} end
  end
  redis.call('RPUSH', steer, cjson.encode({id = ARGV[1], text = ARGV[4]}))
  redis.call('EXPIRE', steer, ARGV[5])
  touch()
  return {'steered', active, kick}
end
for _, waiting in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  if cjson.decode(waiting)['run_id'] == ARGV[1] then
    return {ARGV[2] == 'interrupt' and 'interrupts' or 'queued', busy_with, kick}
  end
end
if ARGV[2] == 'interrupt' then
  redis.call('LPUSH', KEYS[2], ARGV[3])
  touch()
  return {'interrupts', busy_with, kick}
end
if ARGV[2] == 'enqueue' or ARGV[2] == 'steer' then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  touch()
  return {'queued', busy_with, kick}
end
return {'busy', busy_with, kick}
""".replace("STARTING_GRACE", str(STARTING_GRACE_MS))

# KEYS: active, queue, runs, history, index, the releasing turn's lock. ARGV: run_id,
# history JSON, ttl, now, thread id, lease token ('' = unfenced), a follow-up request
# JSON ('' = none). Frees the thread, if the run still holds it and its executor its
# turn; returns the queue's head ('' for none) to be started next, or -1 when fenced out.
_RELEASE_LUA = """
if ARGV[6] ~= '' and redis.call('GET', KEYS[6]) ~= ARGV[6] then return -1 end
local entry = redis.call('GET', KEYS[1])
if entry and string.match(entry, '^(%S+) ') == ARGV[1] then
  redis.call('SET', KEYS[4], ARGV[2], 'EX', ARGV[3])
  redis.call('DEL', KEYS[1])
  if ARGV[7] ~= '' then redis.call('LPUSH', KEYS[2], ARGV[7]) end
  for i = 2, 3 do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
  redis.call('ZADD', KEYS[5], ARGV[4], ARGV[5])
end
return redis.call('LINDEX', KEYS[2], 0) or ''
"""

# KEYS: queue. ARGV: run_id. Drops a waiting request that can never start; returns the
# new head ('' for none).
_DROP_LUA = """
for _, waiting in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if cjson.decode(waiting)['run_id'] == ARGV[1] then redis.call('LREM', KEYS[1], 1, waiting) end
end
return redis.call('LINDEX', KEYS[1], 0) or ''
"""


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
        self._claim = client.register_script(_CLAIM_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._drop = client.register_script(_DROP_LUA)

    def _keys(self, thread_id: str) -> list[str]:
        parts = ("active", "queue", "runs", "history")
        return [*(self.keys.thread(thread_id, part) for part in parts), self.keys.threads_index]

    def claim(
        self, thread_id: str, run_id: str, on_busy: str, request: dict[str, Any], *, now_ms: int
    ) -> ClaimResult:
        """Take the thread for `run_id`, or do with the request what `on_busy` says."""
        steer_text = request.get("prompt") or _messages_text(request.get("messages") or [])
        outcome, detail, kick = self._claim(
            keys=self._keys(thread_id),
            args=[
                run_id,
                on_busy,
                json.dumps(request, separators=(",", ":")),
                steer_text,
                self.ttl_s,
                now_ms,
                self.keys.prefix,
                thread_id,
            ],
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
        fence = active_fence(run_id)
        if fence is not None and not fence.held():
            raise LeaseLost(f"run {run_id}: the turn's lease ran out; the thread is kept")
        head = self._release(
            keys=[
                *self._keys(thread_id),
                fence.lock_key if fence is not None else self.keys.thread(thread_id, "active"),
            ],
            args=[
                run_id,
                json.dumps([m.model_dump(mode="json") for m in history], separators=(",", ":")),
                self.ttl_s,
                now_ms,
                thread_id,
                fence.token if fence is not None else "",
                json.dumps(follow_up, separators=(",", ":")) if follow_up else "",
            ],
        )
        if head == -1:
            raise LeaseLost(f"run {run_id}: lost its turn's lease; the thread is kept")
        return json.loads(head) if head else None

    def drop_queued(self, thread_id: str, run_id: str) -> dict[str, Any] | None:
        """Take a waiting request that can never start out of the queue (so it does not
        hold the thread forever); returns the new head, to be started next."""
        head = self._drop(keys=[self.keys.thread(thread_id, "queue")], args=[run_id])
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
        active_key, queue_key, runs_key, _, index = self._keys(thread_id)
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
        *parts, index = self._keys(thread_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(*parts)
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
