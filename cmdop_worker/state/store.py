"""Run state in Redis: the run record, its result, cancel requests, watchdog entries.

Who calls it: the coordinator's turn task (load, save, open a turn, end the run),
machine workers (mark a call started, record its outcome), the watchdog (claim due
deadlines, fill missing outcomes) and clients (cancel, read the result). `RunStore` is
the façade they use; the per-turn barrier behind it is `barrier`.

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

from collections.abc import Mapping, Sequence
from typing import cast

import redis

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
from cmdop_worker.state.fence import FENCE_FUNCTION, Fence, active_fence
from cmdop_worker.state.keys import Keys, cancel_member
from cmdop_worker.state.records import ParentLink, PendingCall, RunState, parse_state, tool_inputs

# Callers reach the barrier's and the record's names through this façade.
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

# KEYS: the run's state, its lock (or the state again). ARGV: state JSON, fence token
# ('' = unfenced), ttl ('0' = none). Returns 0, writing nothing, when fenced out.
_SAVE_LUA = (
    FENCE_FUNCTION
    + """
if not fenced(KEYS[2], ARGV[2]) then return 0 end
if ARGV[3] == '0' then redis.call('SET', KEYS[1], ARGV[1])
else redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3]) end
return 1
"""
)

# KEYS: state, lock, result, the run's four event keys, then keys that expire with the
# run. ARGV: state JSON, fence token, result JSON, ttl, the terminal event's head, tail,
# maxlen. The ended state, the result and the terminal event are one step; -1 fenced out.
_END_RUN_LUA = (
    FENCE_FUNCTION
    + EMIT_FUNCTION
    + """
if not fenced(KEYS[2], ARGV[2]) then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[4])
redis.call('SET', KEYS[3], ARGV[3], 'EX', ARGV[4])
local seq = emit({KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, ARGV[5], ARGV[6], ARGV[4], ARGV[7])
for i = 8, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return seq
"""
)

# KEYS: state, cancel, control, deadlines, result. ARGV: the request's JSON, its channel,
# ttl, the watchdog member, now, '1' to keep it for a run not stored yet. Returns 0 (no
# such run, or it ended), 1 (written and pushed) or 2 (an earlier request stands: the
# first request is kept, unless this one is ui and that one was not).
_CANCEL_LUA = """
local state = redis.call('GET', KEYS[1])
if state then
  local ok, run = pcall(cjson.decode, state)
  if ok and type(run) == 'table' and run.status ~= 'running' then return 0 end
elseif ARGV[6] ~= '1' or redis.call('EXISTS', KEYS[5]) == 1 then
  return 0
end
local current = redis.call('GET', KEYS[2])
if current then
  if ARGV[2] ~= 'ui' then return 2 end
  local ok, request = pcall(cjson.decode, current)
  if ok and type(request) == 'table' and request.channel == 'ui' then return 2 end
end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[3])
redis.call('PUBLISH', KEYS[3], ARGV[1])
if state then redis.call('ZADD', KEYS[4], ARGV[5], ARGV[4]) end
return 1
"""

# KEYS: deadlines. ARGV: now, limit, claimed (the lease's end).
_CLAIM_LUA = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, member in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[3], member) end
return due
"""

_RELEASE_LUA = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
"""


class RunStore:
    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.barrier = Barrier(client, keys, ttl_s=ttl_s)
        self._save = client.register_script(_SAVE_LUA)
        self._end_run = client.register_script(_END_RUN_LUA)
        self._cancel = client.register_script(_CANCEL_LUA)
        self._claim = client.register_script(_CLAIM_LUA)
        self._release = client.register_script(_RELEASE_LUA)

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
        fence = self._fence(state.run_id)
        ttl = self.ttl_s if state.status != "running" else 0
        key = self.keys.state(state.run_id)
        lock = fence.lock_key if fence is not None else key
        token = fence.token if fence is not None else ""
        if not self._save(keys=[key, lock], args=[state.model_dump_json(), token, ttl]):
            raise LeaseLost(f"run {state.run_id}: turn {state.turn} lost its lease; not saved")

    def end_run(self, state: RunState, result: RunResult, terminal: Frame) -> None:
        """Store the ended state and the result and write the terminal event, in one
        step (fenced inside a turn executor's fence)."""
        run_id = state.run_id
        fence = self._fence(run_id)
        key = self.keys.state(run_id)
        code = self._end_run(
            keys=[
                key,
                fence.lock_key if fence is not None else key,
                self.keys.result(run_id),
                *terminal.keys,
                *self.keys.run_keys(run_id),
            ],
            args=[
                state.model_dump_json(),
                fence.token if fence is not None else "",
                result.model_dump_json(),
                self.ttl_s,
                terminal.head,
                terminal.tail,
                terminal.maxlen,
            ],
        )
        if int(code) < 0:
            raise LeaseLost(f"run {run_id}: turn {state.turn} lost its lease; not ended")

    def _fence(self, run_id: str) -> Fence | None:
        fence = active_fence(run_id)
        if fence is not None and not fence.held():
            raise LeaseLost(f"run {run_id}: the turn's lease ran out; nothing written")
        return fence

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
        key = self.keys
        code = self._cancel(
            keys=[
                key.state(run_id),
                key.cancel(run_id),
                key.control(run_id),
                key.deadlines,
                key.result(run_id),
            ],
            args=[
                cancel.model_dump_json(),
                cancel.channel,
                self.ttl_s,
                cancel_member(run_id),  # the watchdog: the fallback to the pushed copy
                now_ms,
                "1" if before_start else "0",
            ],
        )
        return int(code) > 0

    # -- the per-turn barrier (`barrier`) -----------------------------------------------

    def open_turn(
        self,
        run_id: str,
        turn: int,
        expected: int,
        *,
        save: RunState | None = None,
        sequence: Sequence[QueuedCall] = (),
        schedule: Mapping[str, int] | None = None,
    ) -> bool:
        """Declare how many outcomes turn `turn` waits for; True if already complete.
        In the same atomic step: save the run's state (fenced), store a sequential
        turn's calls in order (the first is the one out), schedule watchdog entries."""
        fence = self._fence(run_id) if save is not None else None
        return self.barrier.open_turn(
            run_id,
            turn,
            expected,
            save=save.model_dump_json() if save is not None else "",
            fence=fence,
            sequence=sequence,
            schedule=schedule,
        )

    def record_outcome(
        self,
        run_id: str,
        turn: int,
        outcome: ToolOutcome,
        events: Sequence[Frame] = (),
        *,
        start: Frame | None = None,
    ) -> Recorded:
        """Store an outcome once, writing `events` (the run's) with it, not otherwise."""
        return self.barrier.record_outcome(run_id, turn, outcome, events, start=start)[0]

    def outcome(self, run_id: str, turn: int, tool_use_id: str) -> ToolOutcome | None:
        raw = self.redis.hget(self.keys.turn(run_id, turn, "results"), tool_use_id)
        return None if raw is None else ToolOutcome.model_validate_json(raw)

    def outcomes(self, run_id: str, turn: int) -> dict[str, ToolOutcome]:
        raw = self.redis.hgetall(self.keys.turn(run_id, turn, "results"))
        return {_text(k): ToolOutcome.model_validate_json(v) for k, v in raw.items()}

    def start_call(
        self,
        run_id: str,
        turn: int,
        tool_use_id: str,
        holder: str,
        *,
        deadline_passed: bool,
        start_event: Frame,
        call_deadline_passed: bool = False,
        machine: str | None = None,
        digest: str = "",
    ) -> tuple[Started, str]:
        """Mark a call started by `holder` and write its TOOL_START, in one step with
        checking that it has no outcome yet (so a watchdog answer and a late start cannot
        both happen), no cancel to honour at once and, given `call_deadline_passed`, no
        start past the call's own deadline (LATE). Returns how the call stands and with
        it: who started it before (AGAIN), the cancel request's JSON (CANCELLED), else
        ''. (An operation cancel does not stop a call: the loop's next boundary
        honours it.) First of all, the message's `digest` must be what its sender
        recorded for the call to `machine` (`state.sent`): else UNSENT, nothing done
        (no digest: a coordinator's own tool, which no message started)."""
        return self.barrier.start_call(
            run_id,
            turn,
            tool_use_id,
            holder,
            deadline_passed=deadline_passed,
            start_event=start_event,
            call_deadline_passed=call_deadline_passed,
            machine=machine,
            digest=digest,
        )

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
        due = cast(
            list[str],
            self._claim(keys=[self.keys.deadlines], args=[now_ms, limit, now_ms + lease_ms]),
        )
        return [_text(m) for m in due]

    def release_claim(self, member: str, claimed_ms: int) -> None:
        """Remove a handled entry, unless it was scheduled anew since it was claimed."""
        self._release(keys=[self.keys.deadlines], args=[member, claimed_ms])


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
