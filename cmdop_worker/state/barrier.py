"""The per-turn barrier: a turn's outcomes, its calls' starts, a sequential turn's order.

Used through `RunStore` (its façade) by the coordinator (open a turn), machine workers
(start a call, record its outcome), the watchdog, liveness and recovery.

The barrier is one Lua script: an outcome is stored once per `tool_use_id` (HSETNX),
and the writer that makes the count reach the turn's expected number, and also wins a
`SET NX` on the turn's `advanced` key, is told to advance. Exactly one writer advances
a turn, whichever of tool task, watchdog or cancel listener gets there first. The same
script schedules the watchdog entry `advance:<run>:<next turn>` (`ADVANCE_GRACE_MS`
ahead), so a writer killed between the script and enqueueing the next turn does not
strand the run: the watchdog enqueues it (`recovery.resume_turn`).

A sequential turn (`parallel_tools=false`) keeps its calls in Redis: `calls` (each
call's `QueuedCall`), `queue` (the ids still to come, in the model's order) and
`current` (the call out now). Only the first is sent when the turn opens; the script
that records the current call's outcome pops the next call without an outcome and
hands it to that writer to send — exactly once, whoever the writer is — and schedules
`advance:<run>:<n>` a grace ahead, which the sender removes once it has sent it (a
sender that died leaves it to recovery). A call that waits (a parked approval) holds
back the rest. `close_sequence` ends the hand-outs, for a filler answering every call.

A queued call keeps its own timeout; its deadline is set as it is handed out
(`QueuedCall.handed_out`) and the script pushes the turn's `turn:` entry past it, so a
wait before it (a parked call ahead) eats neither its time nor the watchdog's. Handed
out while the run has a cancel request (`Handed.cancel`), it is answered "cancelled …
before it started", never sent: an operation cancel starts no further call of a turn.

A call's TOOL_START written with its outcome (a call answered without starting) is
written only when no start was marked, so no call gets two.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import redis

from cmdop_worker.errors import LeaseLost
from cmdop_worker.models import CancelRequest, ToolOutcome
from cmdop_worker.state.events import EMIT_FUNCTION, Frame
from cmdop_worker.state.fence import FENCE_FUNCTION, Fence
from cmdop_worker.state.keys import Keys, advance_member, turn_member
from cmdop_worker.state.queued import QueuedCall

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

# The turn's deadline entry pushed past a call handed out now (`QueuedCall.handed_out`).
_COVER_FUNCTION = """
local function cover(deadlines, member, queued, now)
  local ok, q = pcall(cjson.decode, queued)
  if not ok or type(q) ~= 'table' then return end
  local timeout, cap = tonumber(q.timeout_ms) or 0, tonumber(q.run_deadline_ms) or 0
  if timeout <= 0 or cap <= 0 then return end
  local due = math.min(now + timeout, cap) + (tonumber(q.grace_ms) or 0)
  redis.call('ZADD', deadlines, 'GT', string.format('%.0f', due), member)
end
"""

# KEYS: results, expected, advanced, deadlines, current, queue, calls, started, the
# run's cancel, then its four event keys. ARGV: id, outcome, ttl, member, due, event
# maxlen, '1' when the first event is a TOOL_START (written only if the call was never
# marked started), the sequence's resend entry and its due, now, the turn's deadline
# entry, then head and tail of each event. Returns the advance code, the call handed
# out (or false) and the run's cancel request (or false).
_RECORD_LUA = (
    EMIT_FUNCTION
    + _ADVANCE_FUNCTION
    + _COVER_FUNCTION
    + """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return {-1, false, false} end
redis.call('EXPIRE', KEYS[1], ARGV[3])
local ev = {KEYS[10], KEYS[11], KEYS[12], KEYS[13]}
for i = 12, #ARGV, 2 do
  if not (i == 12 and ARGV[7] == '1' and redis.call('EXISTS', KEYS[8]) == 1) then
    emit(ev, ARGV[i], ARGV[i + 1], '0', ARGV[6])
  end
end
local handed, cancel = false, false
if redis.call('GET', KEYS[5]) == ARGV[1] then
  while true do
    local id = redis.call('LPOP', KEYS[6])
    if not id then redis.call('DEL', KEYS[5]) break end
    if redis.call('HEXISTS', KEYS[1], id) == 0 then
      redis.call('SET', KEYS[5], id, 'EX', ARGV[3])
      redis.call('ZADD', KEYS[4], ARGV[9], ARGV[8])
      handed = redis.call('HGET', KEYS[7], id)
      cancel = redis.call('GET', KEYS[9])
      if handed and not cancel then cover(KEYS[4], ARGV[11], handed, tonumber(ARGV[10])) end
      break
    end
  end
end
local expected = tonumber(redis.call('GET', KEYS[2]) or '-1')
local code = advance_if_complete(KEYS[1], KEYS[3], KEYS[4], expected, ARGV[3], ARGV[4], ARGV[5])
return {code, handed, cancel}
"""
)

# KEYS: results, expected, advanced, deadlines, the run's state, the turn lock, current,
# queue, calls. ARGV: expected, ttl, member, due, the state's JSON to save ('' = none),
# the fence token ('' = unfenced), the sequence's first call id ('' = none), the number
# n of its calls, n (id, QueuedCall JSON) pairs, then watchdog entries to schedule
# (member, due pairs; an entry already later stays). Saving, declaring the order,
# scheduling and opening are one step.
_OPEN_TURN_LUA = (
    FENCE_FUNCTION
    + _ADVANCE_FUNCTION
    + """
if ARGV[5] ~= '' then
  if not fenced(KEYS[6], ARGV[6]) then return -1 end
  redis.call('SET', KEYS[5], ARGV[5])
end
local n = tonumber(ARGV[8])
if ARGV[7] ~= '' then
  redis.call('DEL', KEYS[8], KEYS[9])
  redis.call('SET', KEYS[7], ARGV[7], 'EX', ARGV[2])
  for i = 9, 8 + 2 * n, 2 do
    redis.call('HSET', KEYS[9], ARGV[i], ARGV[i + 1])
    if ARGV[i] ~= ARGV[7] then redis.call('RPUSH', KEYS[8], ARGV[i]) end
  end
  redis.call('EXPIRE', KEYS[8], ARGV[2])
  redis.call('EXPIRE', KEYS[9], ARGV[2])
end
for i = 9 + 2 * n, #ARGV, 2 do redis.call('ZADD', KEYS[4], 'GT', ARGV[i + 1], ARGV[i]) end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
local expected = tonumber(ARGV[1])
return advance_if_complete(KEYS[1], KEYS[3], KEYS[4], expected, ARGV[2], ARGV[3], ARGV[4])
"""
)

# KEYS: results, started, cancel, then the run's four event keys, then the call's sent
# record. ARGV: tool_use_id, holder, ttl, '1' when the run's deadline has passed, event
# maxlen, TOOL_START's head and tail, '1' when the call's own deadline has passed, the
# message's digest (`sent.call_digest`; '' for a call the coordinator runs itself,
# which no message started). A message its sender's record does not match
# (or with no record) was not sent by the control plane: nothing is read or written
# for it. A cancel to honour at once
# (`cancel.must_stop_now`: a ui cancel, or any cancel past the deadline) keeps the call
# from starting, and so does its deadline (a call never started before it); otherwise
# the call is marked started and its TOOL_START written in the same step.
_START_CALL_LUA = (
    EMIT_FUNCTION
    + """
if ARGV[9] ~= '' and redis.call('GET', KEYS[8]) ~= ARGV[9] then return {'unsent', ''} end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return {'answered', ''} end
local cancel = redis.call('GET', KEYS[3])
if cancel then
  local ok, request = pcall(cjson.decode, cancel)
  if ARGV[4] == '1' or (ok and type(request) == 'table' and request.channel == 'ui') then
    return {'cancelled', cancel}
  end
end
if ARGV[8] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then return {'late', ''} end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'EX', ARGV[3]) then
  emit({KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, ARGV[6], ARGV[7], '0', ARGV[5])
  return {'first', ''}
end
return {'again', redis.call('GET', KEYS[2]) or ''}
"""
)

# A writer that completed a turn normally enqueues the next one within milliseconds;
# the watchdog steps in only after this long (a duplicate enqueue would be harmless).
ADVANCE_GRACE_MS = 5_000


class Started(Enum):
    FIRST = "first"  # this is the call's first start: run it
    AGAIN = "again"  # started before (by `holder`) and not answered: never run it twice
    ANSWERED = "answered"  # the call already has an outcome
    CANCELLED = "cancelled"  # a cancel to honour at once came first: never start it
    LATE = "late"  # the call's own deadline passed before it started: never start it
    UNSENT = "unsent"  # no sender's record matches this message: a forgery, never run it


class Recorded(Enum):
    ADVANCE = "advance"  # this writer completed the turn: it must enqueue the next one
    STORED = "stored"
    DUPLICATE = "duplicate"  # an outcome for this call was already stored


@dataclass(frozen=True)
class Handed:
    """A sequential turn's next call, handed out to the writer of the call before it."""

    call: QueuedCall  # with its deadline counted from the hand-out
    cancel: CancelRequest | None = None  # the run's: answer the call, never send it


class Barrier:
    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._record = client.register_script(_RECORD_LUA)
        self._open_turn = client.register_script(_OPEN_TURN_LUA)
        self._start_call = client.register_script(_START_CALL_LUA)

    def open_turn(
        self,
        run_id: str,
        turn: int,
        expected: int,
        *,
        save: str = "",
        fence: Fence | None = None,
        sequence: Sequence[QueuedCall] = (),
        schedule: Mapping[str, int] | None = None,
    ) -> bool:
        if fence is not None and save and not fence.held():
            raise LeaseLost(f"run {run_id}: turn {turn} is no longer ours; not dispatched")
        entries = [part for member, due in (schedule or {}).items() for part in (member, due)]
        calls = [part for q in sequence for part in (q.tool_use_id, q.model_dump_json())]
        code = self._open_turn(
            keys=[
                *self._keys(run_id, turn),
                self.keys.state(run_id),
                fence.lock_key if fence is not None else self.keys.turn(run_id, turn, "lock"),
                *self._sequence_keys(run_id, turn),
            ],
            args=[
                expected,
                self.ttl_s,
                *self._next_entry(run_id, turn),
                save,
                fence.token if fence is not None else "",
                sequence[0].tool_use_id if sequence else "",
                len(sequence),
                *calls,
                *entries,
            ],
        )
        if int(code) < 0:
            raise LeaseLost(f"run {run_id}: turn {turn} lost its lease; not dispatched")
        return bool(code)

    def record_outcome(
        self,
        run_id: str,
        turn: int,
        outcome: ToolOutcome,
        events: Sequence[Frame] = (),
        *,
        start: Frame | None = None,
    ) -> tuple[Recorded, Handed | None]:
        """Store an outcome once, writing `events` with it (and first `start`, the
        call's TOOL_START, unless the call was marked started); returns with it the next
        call of a sequential turn when this one was out: the caller is to send it (to
        answer it, given the run's cancel request)."""
        events = [start, *events] if start is not None else list(events)
        now = _now_ms()
        code, handed, cancel = self._record(
            keys=[
                *self._keys(run_id, turn),
                *self._sequence_keys(run_id, turn),
                self.keys.tool_started(run_id, outcome.tool_use_id),
                self.keys.cancel(run_id),
                *(events[0].keys if events else []),
            ],
            args=[
                outcome.tool_use_id,
                outcome.model_dump_json(),
                self.ttl_s,
                *self._next_entry(run_id, turn),
                events[0].maxlen if events else 0,
                "1" if start is not None else "0",
                advance_member(run_id, turn),
                now + ADVANCE_GRACE_MS,
                now,
                turn_member(run_id, turn),
                *(part for event in events for part in (event.head, event.tail)),
            ],
        )
        recorded = {1: Recorded.ADVANCE, 0: Recorded.STORED}.get(int(code), Recorded.DUPLICATE)
        if handed is None:
            return recorded, None
        queued = QueuedCall.model_validate_json(handed)
        if cancel is None:
            return recorded, Handed(queued.handed_out(now))
        return recorded, Handed(queued, CancelRequest.model_validate_json(cancel))

    def hand_out_again(self, run_id: str, turn: int, queued: QueuedCall) -> QueuedCall:
        """The call out now, as re-sent by recovery (its sender died): its deadline
        counted from now, and the turn's deadline entry pushed past it."""
        again = queued.handed_out(_now_ms())
        if again is not queued:
            self.redis.zadd(
                self.keys.deadlines, {turn_member(run_id, turn): again.deadline_ms}, gt=True
            )
        return again

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
        status, detail = self._start_call(
            keys=[
                self.keys.turn(run_id, turn, "results"),
                self.keys.tool_started(run_id, tool_use_id),
                self.keys.cancel(run_id),
                *start_event.keys,
                self.keys.sent(run_id, tool_use_id, machine or "-"),
            ],
            args=[
                tool_use_id,
                holder,
                self.ttl_s,
                "1" if deadline_passed else "0",
                start_event.maxlen,
                start_event.head,
                start_event.tail,
                "1" if call_deadline_passed else "0",
                digest,
            ],
        )
        return Started(_text(status)), _text(detail)

    def current_call(self, run_id: str, turn: int) -> str | None:
        """The call of a sequential turn that is out now (None: none, or not sequential)."""
        raw = self.redis.get(self.keys.turn(run_id, turn, "current"))
        return None if raw is None else _text(raw)

    def queued_call(self, run_id: str, turn: int, tool_use_id: str) -> QueuedCall | None:
        raw = self.redis.hget(self.keys.turn(run_id, turn, "calls"), tool_use_id)
        return None if raw is None else QueuedCall.model_validate_json(raw)

    def close_sequence(self, run_id: str, turn: int) -> None:
        """No further call of this sequential turn is handed out (its filler answers all)."""
        self.redis.delete(*self._sequence_keys(run_id, turn)[:2])

    def _keys(self, run_id: str, turn: int) -> list[str]:
        return [
            self.keys.turn(run_id, turn, "results"),
            self.keys.turn(run_id, turn, "expected"),
            self.keys.turn(run_id, turn, "advanced"),
            self.keys.deadlines,
        ]

    def _sequence_keys(self, run_id: str, turn: int) -> list[str]:
        return [self.keys.turn(run_id, turn, part) for part in ("current", "queue", "calls")]

    def _next_entry(self, run_id: str, turn: int) -> tuple[str, int]:
        return advance_member(run_id, turn + 1), _now_ms() + ADVANCE_GRACE_MS


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
