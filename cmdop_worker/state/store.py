"""Run state in Redis: the run record, its result, cancel requests, watchdog entries.

Who calls it: the coordinator's turn task (load, save, open a turn, end the run),
machine workers (mark a call started, record its outcome), the watchdog (claim due
deadlines, fill missing outcomes) and clients (cancel, read the result). `RunStore` is
the one way in (`rt.store`, `client.store`): the per-turn barrier (a turn's outcomes,
its calls' starts, a sequential turn's order) is its base class, in `barrier`.

Writes of a run's state made inside a turn executor's fence (`fence.fenced`) land only
while its lease holds: `save`, `open_turn` and `end_run` check the turn lock's token in
the same Lua step as the write, and raise `LeaseLost` having written nothing.

A cancel request is written by one script that keeps the first request unless a ui
request follows an operation one: a ui cancel is never downgraded. A submitter may
cancel a run whose `cmdop.run` is still queued (`before_start`): the request waits in
the cancel key (with the run TTL) and the run ends CANCELLED as its first turn begins.

Watchdog entries are claimed with a lease (`claim_due` moves them `lease_ms` ahead
instead of removing them) and removed only when handled (`release_claim`), so an entry
whose claimant died comes due again.
"""

from __future__ import annotations

from typing import cast

from cmdop_worker.errors import LeaseLost
from cmdop_worker.models import CancelRequest, RunResult, ToolOutcome
from cmdop_worker.state.barrier import (
    ADVANCE_GRACE_MS,
    Barrier,
    QueuedCall,
    Recorded,
    Started,
)
from cmdop_worker.state.events import EMIT_FUNCTION, Frame
from cmdop_worker.state.fence import FENCE_FUNCTION, write_fence
from cmdop_worker.state.keys import cancel_member
from cmdop_worker.state.records import ParentLink, PendingCall, RunState, parse_state, tool_inputs
from cmdop_worker.state.scripts import run_script

# Callers reach the barrier's and the record's names through this module.
__all__ = [
    "ADVANCE_GRACE_MS",
    "ParentLink",
    "PendingCall",
    "QueuedCall",
    "Recorded",
    "RunState",
    "RunStore",
    "Started",
    "parse_state",
    "tool_inputs",
]

# Stores the run's state unless fenced out (0, nothing written); a ttl of '0': none.
_SAVE_LUA = (
    FENCE_FUNCTION
    + """
local state_key, lock_key, attempts_key = KEYS[1], KEYS[2], KEYS[3]
local state, token, attempt, lease_ms, ttl_s = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if not fenced(lock_key, attempts_key, token, attempt, lease_ms) then return 0 end
if ttl_s == '0' then redis.call('SET', state_key, state)
else redis.call('SET', state_key, state, 'EX', ttl_s) end
return 1
"""
)

# The ended state, the result and the terminal event are one step; the run's other
# keys (after the event keys) expire with it. Returns the event's seq; -1 fenced out.
_END_RUN_LUA = (
    FENCE_FUNCTION
    + EMIT_FUNCTION
    + """
local state_key, lock_key, attempts_key, result_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local event_keys = {KEYS[5], KEYS[6], KEYS[7], KEYS[8]}
local FIRST_RUN_KEY = 9  -- then every key that expires with the run
local state, token, attempt, lease_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local result, ttl_s = ARGV[5], ARGV[6]
local event_head, event_tail, event_maxlen = ARGV[7], ARGV[8], ARGV[9]
if not fenced(lock_key, attempts_key, token, attempt, lease_ms) then return -1 end
redis.call('SET', state_key, state, 'EX', ttl_s)
redis.call('SET', result_key, result, 'EX', ttl_s)
local seq = emit(event_keys, event_head, event_tail, ttl_s, event_maxlen)
for i = FIRST_RUN_KEY, #KEYS do redis.call('EXPIRE', KEYS[i], ttl_s) end
return seq
"""
)

# Writes and pushes a cancel request. Returns 0 (no such run, or it ended), 1 (written
# and pushed) or 2 (an earlier request stands: the first request is kept, unless this
# one is ui and that one was not). `before_start` ('1'): keep it for a run not stored
# yet (its `cmdop.run` may still be queued), unless the run already has a result.
_CANCEL_LUA = """
local state_key, cancel_key, control_key, deadlines_key, result_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local request, channel, ttl_s = ARGV[1], ARGV[2], ARGV[3]
local watchdog_member, now_ms, before_start = ARGV[4], ARGV[5], ARGV[6] == '1'
local state = redis.call('GET', state_key)
if state then
  local ok, run = pcall(cjson.decode, state)
  if ok and type(run) == 'table' and run.status ~= 'running' then return 0 end
elseif not before_start or redis.call('EXISTS', result_key) == 1 then
  return 0
end
local current = redis.call('GET', cancel_key)
if current then
  if channel ~= 'ui' then return 2 end
  local ok, earlier = pcall(cjson.decode, current)
  if ok and type(earlier) == 'table' and earlier.channel == 'ui' then return 2 end
end
redis.call('SET', cancel_key, request, 'EX', ttl_s)
redis.call('PUBLISH', control_key, request)
if state then redis.call('ZADD', deadlines_key, now_ms, watchdog_member) end
return 1
"""

# Claims the due watchdog entries: each moves to `claimed_ms` (the claim's end).
_CLAIM_LUA = """
local deadlines_key = KEYS[1]
local now_ms, limit, claimed_ms = ARGV[1], ARGV[2], ARGV[3]
local due = redis.call('ZRANGEBYSCORE', deadlines_key, '-inf', now_ms, 'LIMIT', 0, limit)
for _, member in ipairs(due) do redis.call('ZADD', deadlines_key, claimed_ms, member) end
return due
"""

# Removes a handled entry, unless it was scheduled anew since it was claimed.
_RELEASE_LUA = """
local deadlines_key = KEYS[1]
local member, claimed_ms = ARGV[1], ARGV[2]
local score = redis.call('ZSCORE', deadlines_key, member)
if score and tonumber(score) == tonumber(claimed_ms) then
  return redis.call('ZREM', deadlines_key, member)
end
return 0
"""


class RunStore(Barrier):
    """The run's state in Redis, the per-turn barrier's methods included (`Barrier`)."""

    # -- the run record -------------------------------------------------------------

    def create(self, state: RunState) -> bool:
        """Store a new run; False when a run with this id already exists."""
        return bool(self.redis.set(self.keys.state(state.run_id), state.model_dump_json(), nx=True))

    def load(self, run_id: str) -> RunState | None:
        return parse_state(self.load_raw(run_id))

    def load_raw(self, run_id: str) -> str | bytes | None:
        """The run record's JSON, unparsed."""
        return cast("str | bytes | None", self.redis.get(self.keys.state(run_id)))

    def save(self, state: RunState) -> None:
        """Store the run's state (fenced inside a turn executor's fence)."""
        key = self.keys.state(state.run_id)
        fence = write_fence(state.run_id, unfenced_lock=key, refused="nothing written")
        saved = run_script(
            self.redis,
            _SAVE_LUA,
            keys={"state": key, **fence.keys},
            args={
                "state": state.model_dump_json(),
                **fence.args,
                "ttl_s": self.ttl_s if state.status != "running" else 0,
            },
        )
        if not saved:
            raise LeaseLost(f"run {state.run_id}: turn {state.turn} lost its lease; not saved")

    def end_run(self, state: RunState, result: RunResult, terminal: Frame) -> None:
        """Store the ended state and the result and write the terminal event, in one
        step (fenced inside a turn executor's fence)."""
        run_id = state.run_id
        key = self.keys.state(run_id)
        fence = write_fence(run_id, unfenced_lock=key, refused="nothing written")
        code = run_script(
            self.redis,
            _END_RUN_LUA,
            keys={"state": key, **fence.keys, "result": self.keys.result(run_id)},
            args={
                "state": state.model_dump_json(),
                **fence.args,
                "result": result.model_dump_json(),
                "ttl_s": self.ttl_s,
                "event_head": terminal.head,
                "event_tail": terminal.tail,
                "event_maxlen": terminal.maxlen,
            },
            more_keys=[*terminal.keys, *self.keys.run_keys(run_id)],
        )
        if int(code) < 0:
            raise LeaseLost(f"run {run_id}: turn {state.turn} lost its lease; not ended")

    def store_result(self, result: RunResult) -> None:
        self.redis.set(self.keys.result(result.run_id), result.model_dump_json(), ex=self.ttl_s)
        for key in self.keys.run_keys(result.run_id):
            self.redis.expire(key, self.ttl_s)

    def load_result(self, run_id: str) -> RunResult | None:
        raw = self.redis.get(self.keys.result(run_id))
        return None if raw is None else RunResult.model_validate_json(raw)

    # -- cancel -----------------------------------------------------------------------

    def cancel_request(self, run_id: str) -> CancelRequest | None:
        raw = self.redis.get(self.keys.cancel(run_id))
        return None if raw is None else CancelRequest.model_validate_json(raw)

    def request_cancel(
        self, run_id: str, cancel: CancelRequest, *, now_ms: int, before_start: bool = False
    ) -> bool:
        """Write and push a cancel request; True when the run is (now) being cancelled.
        A ui request already there is kept over a later operation one, and any earlier
        request over a later one of the same channel. False (nothing written) when the
        run ended, or has no record — unless `before_start`: the caller submitted it and
        its `cmdop.run` may still be queued, so the request is kept for its start."""
        code = run_script(
            self.redis,
            _CANCEL_LUA,
            keys={
                "state": self.keys.state(run_id),
                "cancel": self.keys.cancel(run_id),
                "control": self.keys.control(run_id),
                "deadlines": self.keys.deadlines,
                "result": self.keys.result(run_id),
            },
            args={
                "request": cancel.model_dump_json(),
                "channel": cancel.channel,
                "ttl_s": self.ttl_s,
                "watchdog_member": cancel_member(run_id),  # the fallback to the pushed copy
                "now_ms": now_ms,
                "before_start": "1" if before_start else "0",
            },
        )
        return int(code) > 0

    # -- a turn's outcomes (written by the barrier, `record_outcome`) --------------------

    def outcome(self, run_id: str, turn: int, tool_use_id: str) -> ToolOutcome | None:
        raw = self.redis.hget(self.keys.turn(run_id, turn, "results"), tool_use_id)
        return None if raw is None else ToolOutcome.model_validate_json(raw)

    def outcomes(self, run_id: str, turn: int) -> dict[str, ToolOutcome]:
        raw = self.redis.hgetall(self.keys.turn(run_id, turn, "results"))
        return {_text(k): ToolOutcome.model_validate_json(v) for k, v in raw.items()}

    def was_started(self, run_id: str, tool_use_id: str) -> bool:
        return bool(self.redis.exists(self.keys.tool_started(run_id, tool_use_id)))

    # -- deadlines ----------------------------------------------------------------------

    def schedule(self, member: str, due_ms: int) -> None:
        self.redis.zadd(self.keys.deadlines, {member: due_ms})

    def unschedule(self, *members: str) -> None:
        if members:
            self.redis.zrem(self.keys.deadlines, *members)

    def claim_due(self, now_ms: int, *, lease_ms: int, limit: int = 100) -> list[str]:
        """Due watchdog entries, each to exactly one claimant: they are moved to
        `now_ms + lease_ms` (the claim), to come due again if the claimant dies."""
        due = run_script(
            self.redis,
            _CLAIM_LUA,
            keys={"deadlines": self.keys.deadlines},
            args={"now_ms": now_ms, "limit": limit, "claimed_ms": now_ms + lease_ms},
        )
        return [_text(m) for m in cast(list[str], due)]

    def release_claim(self, member: str, claimed_ms: int) -> None:
        """Remove a handled entry, unless it was scheduled anew since it was claimed."""
        run_script(
            self.redis,
            _RELEASE_LUA,
            keys={"deadlines": self.keys.deadlines},
            args={"member": member, "claimed_ms": claimed_ms},
        )


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
