"""Run state in Redis: the run record, cancel requests, the per-turn result barrier.

Who calls it: the coordinator's turn task (load, save, open a turn), machine workers
(mark a call started, record its outcome), the watchdog (claim due deadlines, fill
missing outcomes) and clients (cancel, read the result).

The barrier is one Lua script: an outcome is stored once per `tool_use_id` (HSETNX),
and the writer that makes the count reach the turn's expected number, and also wins a
`SET NX` on the turn's `advanced` key, is told to advance. Exactly one writer advances
a turn, whichever of tool task, watchdog or cancel listener gets there first. The same
script schedules the watchdog entry `advance:<run>:<next turn>` (`ADVANCE_GRACE_MS`
ahead), so a writer killed between the script and enqueueing the next turn does not
strand the run: the watchdog enqueues it (`recovery.resume_turn`).

Watchdog entries are claimed with a lease (`claim_due` moves them `lease_ms` ahead
instead of removing them) and removed only when handled (`release_claim`), so an entry
whose claimant died comes due again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import cast

import redis
from pydantic import BaseModel, ConfigDict

from cmdop_worker.models import (
    CancelRequest,
    Message,
    RunRequest,
    RunResult,
    RunStatus,
    ToolOutcome,
    Usage,
)
from cmdop_worker.state.events import EMIT_FUNCTION, Frame
from cmdop_worker.state.keys import Keys, advance_member, cancel_member

# The barrier's one rule, shared by both scripts that can complete a turn: once the
# turn's results reach the expected count, the first writer to win the `advanced` key
# advances it, scheduling the watchdog's `advance:` entry for the next turn. Returns 1
# to that writer, else 0. `expected` < 0: the count is not declared yet.
_ADVANCE_FUNCTION = """
local function advance_if_complete(results, advanced, deadlines, expected, ttl, member, due)
  if expected >= 0 and redis.call('HLEN', results) >= expected then
    if redis.call('SET', advanced, '1', 'NX', 'EX', ttl) then
      redis.call('ZADD', deadlines, due, member)
      return 1
    end
  end
  return 0
end
"""

# KEYS: results, expected, advanced, deadlines, then the run's four event keys.
# ARGV: id, outcome, ttl, member, due, event maxlen, then head and tail of each event
# that reports the outcome (TOOL_END, after a TOOL_START when the call never started):
# they are written with it or, for a duplicate, not at all.
_RECORD_LUA = (
    EMIT_FUNCTION
    + _ADVANCE_FUNCTION
    + """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return -1 end
redis.call('EXPIRE', KEYS[1], ARGV[3])
for i = 7, #ARGV, 2 do
  emit({KEYS[5], KEYS[6], KEYS[7], KEYS[8]}, ARGV[i], ARGV[i + 1], '0', ARGV[6])
end
local expected = tonumber(redis.call('GET', KEYS[2]) or '-1')
return advance_if_complete(KEYS[1], KEYS[3], KEYS[4], expected, ARGV[3], ARGV[4], ARGV[5])
"""
)

# KEYS: results, expected, advanced, deadlines, the run's state. ARGV: expected, ttl,
# member, due, the state's JSON to save ('' = none), then watchdog entries to schedule
# (member, due pairs). Saving, scheduling and opening are one atomic step.
_OPEN_TURN_LUA = (
    _ADVANCE_FUNCTION
    + """
if ARGV[5] ~= '' then redis.call('SET', KEYS[5], ARGV[5]) end
for i = 6, #ARGV, 2 do redis.call('ZADD', KEYS[4], ARGV[i + 1], ARGV[i]) end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
local expected = tonumber(ARGV[1])
return advance_if_complete(KEYS[1], KEYS[3], KEYS[4], expected, ARGV[2], ARGV[3], ARGV[4])
"""
)

# KEYS: results, started, cancel, then the run's four event keys. ARGV: tool_use_id,
# holder, ttl, '1' when the run's deadline has passed, event maxlen, TOOL_START's head
# and tail. A cancel to honour at once (`cancel.must_stop_now`: a ui cancel, or any
# cancel past the deadline) keeps the call from starting; otherwise the call is marked
# started and its TOOL_START written in the same step.
_START_CALL_LUA = (
    EMIT_FUNCTION
    + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return {'answered', ''} end
local cancel = redis.call('GET', KEYS[3])
if cancel then
  local ok, request = pcall(cjson.decode, cancel)
  if ARGV[4] == '1' or (ok and type(request) == 'table' and request.channel == 'ui') then
    return {'cancelled', cancel}
  end
end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'EX', ARGV[3]) then
  emit({KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, ARGV[6], ARGV[7], '0', ARGV[5])
  return {'first', ''}
end
return {'again', redis.call('GET', KEYS[2]) or ''}
"""
)

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

# A writer that completed a turn normally enqueues the next one within milliseconds;
# the watchdog steps in only after this long (a duplicate enqueue would be harmless).
ADVANCE_GRACE_MS = 5_000


class Started(Enum):
    FIRST = "first"  # this is the call's first start: run it
    AGAIN = "again"  # started before (by `holder`) and not answered: never run it twice
    ANSWERED = "answered"  # the call already has an outcome
    CANCELLED = "cancelled"  # a cancel to honour at once came first: never start it


class Recorded(Enum):
    ADVANCE = "advance"  # this writer completed the turn: it must enqueue the next one
    STORED = "stored"
    DUPLICATE = "duplicate"  # an outcome for this call was already stored


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PendingCall(Frozen):
    """A tool call of the turn in flight, awaiting its outcome."""

    tool_use_id: str
    tool: str
    machine: str | None = None
    deadline_ms: int


class ParentLink(Frozen):
    """Set on a child run started by `ask_machine`: where its answer goes."""

    run_id: str
    turn: int
    tool_use_id: str
    tool: str
    host: str
    depth: int = 1  # the child's: a top-level run is 0 (records from before: 1)


class RunState(Frozen):
    run_id: str
    request: RunRequest
    model: str
    system_prompt: str
    max_turns: int
    parallel_tools: bool  # the agent's and the request's, resolved when the run starts
    tool_tags: list[str] | None = None
    token_budget: int
    status: RunStatus = "running"
    turn: int = 0
    history: list[Message]
    usage: Usage = Usage()
    awaiting: list[PendingCall] = []
    started_ms: int
    deadline_ms: int
    text: str = ""
    output_retry_used: bool = False
    parent: ParentLink | None = None
    origin: str = ""  # the task that started the run: its redelivery is not a duplicate

    @property
    def depth(self) -> int:
        """How deep in `ask_machine` runs this one is: 0 top-level, 1 its child, ..."""
        return self.parent.depth if self.parent is not None else 0


def parse_state(raw: str | bytes | None) -> RunState | None:
    """A run record as stored (`RunStore.load_raw`), parsed; None for no record."""
    return None if raw is None else RunState.model_validate_json(raw)


class RunStore:
    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._record = client.register_script(_RECORD_LUA)
        self._open_turn = client.register_script(_OPEN_TURN_LUA)
        self._start_call = client.register_script(_START_CALL_LUA)
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
        ttl = self.ttl_s if state.status != "running" else None
        self.redis.set(self.keys.state(state.run_id), state.model_dump_json(), ex=ttl)

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

    def request_cancel(self, run_id: str, cancel: CancelRequest, *, now_ms: int) -> bool:
        """Write and push a cancel request. False (and nothing written) when the run
        is unknown or already ended."""
        state = self.load(run_id)
        if state is None or state.status != "running":
            return False
        payload = cancel.model_dump_json()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.cancel(run_id), payload, ex=self.ttl_s)
        pipe.publish(self.keys.control(run_id), payload)
        # The watchdog is the fallback if no listener got the pushed copy.
        pipe.zadd(self.keys.deadlines, {cancel_member(run_id): now_ms})
        pipe.execute()
        return True

    # -- the per-turn barrier ---------------------------------------------------------

    def open_turn(
        self,
        run_id: str,
        turn: int,
        expected: int,
        *,
        save: RunState | None = None,
        schedule: Mapping[str, int] | None = None,
    ) -> bool:
        """Declare how many outcomes turn `turn` waits for; True if already complete.
        In the same atomic step: save the run's state and schedule watchdog entries."""
        entries = [part for member, due in (schedule or {}).items() for part in (member, due)]
        return bool(
            self._open_turn(
                keys=[*self._barrier_keys(run_id, turn), self.keys.state(run_id)],
                args=[
                    expected,
                    self.ttl_s,
                    *self._next_entry(run_id, turn),
                    save.model_dump_json() if save is not None else "",
                    *entries,
                ],
            )
        )

    def record_outcome(
        self, run_id: str, turn: int, outcome: ToolOutcome, events: Sequence[Frame] = ()
    ) -> Recorded:
        """Store an outcome once, writing `events` (the run's) with it, not otherwise."""
        code = self._record(
            keys=self._barrier_keys(run_id, turn) + (events[0].keys if events else []),
            args=[
                outcome.tool_use_id,
                outcome.model_dump_json(),
                self.ttl_s,
                *self._next_entry(run_id, turn),
                events[0].maxlen if events else 0,
                *(part for event in events for part in (event.head, event.tail)),
            ],
        )
        return {1: Recorded.ADVANCE, 0: Recorded.STORED}.get(int(code), Recorded.DUPLICATE)

    def _barrier_keys(self, run_id: str, turn: int) -> list[str]:
        return [
            self.keys.turn(run_id, turn, "results"),
            self.keys.turn(run_id, turn, "expected"),
            self.keys.turn(run_id, turn, "advanced"),
            self.keys.deadlines,
        ]

    def _next_entry(self, run_id: str, turn: int) -> tuple[str, int]:
        return advance_member(run_id, turn + 1), time.time_ns() // 1_000_000 + ADVANCE_GRACE_MS

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
    ) -> tuple[Started, str]:
        """Mark a call started by `holder` and write its TOOL_START, in one step with
        checking that it has no outcome yet (so a watchdog answer and a late start cannot
        both happen) and no cancel to honour at once. Returns how the call stands and
        with it: who started it before (AGAIN), the cancel request's JSON (CANCELLED),
        else ''. (An operation cancel does not stop a call: the loop's next boundary
        honours it.)"""
        status, detail = self._start_call(
            keys=[
                self.keys.turn(run_id, turn, "results"),
                self.keys.tool_started(run_id, tool_use_id),
                self.keys.cancel(run_id),
                *start_event.keys,
            ],
            args=[
                tool_use_id,
                holder,
                self.ttl_s,
                "1" if deadline_passed else "0",
                start_event.maxlen,
                start_event.head,
                start_event.tail,
            ],
        )
        return Started(_text(status)), _text(detail)

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
