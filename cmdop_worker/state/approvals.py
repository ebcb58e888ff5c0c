"""Parked calls: tool calls whose permission verdict is "ask", waiting for a person.

A parked call holds no worker thread and no Celery slot: all of it is one Redis hash
(`keys.approval`), written in one step, each change a Lua script that sees the call's
state and acts at most once:

- `park` (the machine worker, on "ask"): the record (state `waiting`), the run's index
  of parked calls, the watchdog entry `approval:<run>:<tuid>` at the expiry, the turn's
  deadline entry pushed past that expiry (so the turn's watchdog does not time the
  call out while it waits), and the APPROVAL_REQUEST event. Refused when the call
  already has an outcome or the run has a cancel request.
- `answer` (the client): `waiting` → `approved` | `denied`, once, before the expiry,
  with APPROVAL_RESOLVED. An approval starts the call's own deadline then (its timeout
  length, capped by the run's deadline) and pushes the turn's deadline past it.
- `close` (the coordinator's watchdog and cancel listener): `waiting` → `expired` |
  `cancelled`, once, with APPROVAL_RESOLVED.
- `take` (the machine worker given a `cmdop.tool` task carrying an answer): the task is
  acted on once, and only when the record holds that very answer, so a replayed or
  forged task alone runs nothing.

Who calls it: `machine.worker` (park, take), `surfaces.client` (load, answer), the
coordinator's `approvals` (close, and what a turn's deadline must wait for).
"""

from __future__ import annotations

from typing import Any, Literal, cast

import redis
from pydantic import BaseModel, ConfigDict

from cmdop_worker.models import ApprovalAnswer, ToolCall
from cmdop_worker.state.events import EMIT_FUNCTION, EventSink
from cmdop_worker.state.keys import Keys, approval_member, turn_member

ParkedState = Literal["waiting", "approved", "denied", "expired", "cancelled"]
Parked = Literal["parked", "answered", "again", "cancelled"]
# Why an answer was not taken: the call never parked, was answered, expired, was
# cancelled while it waited, or ended otherwise (its machine was lost).
Refused = Literal["no_request", "answered", "expired", "cancelled", "ended"]
Taken = Literal["ok", "unknown", "forged", "again", "ended"]

# KEYS: record, index, results, cancel, deadlines, the run's four event keys.
# ARGV: tuid, park JSON, expires, timeout, grace, run deadline, turn, ttl, approval
# member, turn member, hold, maxlen, APPROVAL_REQUEST's head and tail.
_PARK_LUA = (
    EMIT_FUNCTION
    + """
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 'answered' end
if redis.call('EXISTS', KEYS[1]) == 1 then return 'again' end
if redis.call('EXISTS', KEYS[4]) == 1 then return 'cancelled' end
redis.call('HSET', KEYS[1], 'park', ARGV[2], 'expires_ms', ARGV[3], 'timeout_ms', ARGV[4],
  'grace_ms', ARGV[5], 'run_deadline_ms', ARGV[6], 'turn', ARGV[7], 'state', 'waiting')
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[9])
redis.call('ZADD', KEYS[5], 'GT', ARGV[11], ARGV[10])
emit({KEYS[6], KEYS[7], KEYS[8], KEYS[9]}, ARGV[13], ARGV[14], '0', ARGV[12])
return 'parked'
"""
)

# KEYS: record, results, deadlines, the run's four event keys. ARGV: tuid, verdict,
# answer JSON, now, approval member, turn member, maxlen, APPROVAL_RESOLVED's head, tail.
_ANSWER_LUA = (
    EMIT_FUNCTION
    + """
local f = redis.call('HMGET', KEYS[1], 'state', 'expires_ms', 'timeout_ms', 'run_deadline_ms',
  'grace_ms')
if not f[1] then return {'no_request', ''} end
if f[1] == 'approved' or f[1] == 'denied' then return {'answered', ''} end
if f[1] ~= 'waiting' then return {f[1], ''} end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {'ended', ''} end
local now = tonumber(ARGV[4])
if now >= tonumber(f[2]) then return {'expired', ''} end
local deadline = ''
if ARGV[2] == 'approved' then
  local ms = math.min(now + tonumber(f[3]), tonumber(f[4]))
  deadline = string.format('%.0f', ms)
  redis.call('ZADD', KEYS[3], 'GT', string.format('%.0f', ms + tonumber(f[5])), ARGV[6])
end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'answer', ARGV[3], 'deadline_ms', deadline)
redis.call('ZREM', KEYS[3], ARGV[5])
emit({KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, ARGV[8], ARGV[9], '0', ARGV[7])
return {'ok', deadline}
"""
)

# KEYS: record, results, deadlines, the run's four event keys. ARGV: tuid, verdict,
# answer JSON, approval member, maxlen, APPROVAL_RESOLVED's head and tail. Returns 1
# when the caller is to record the call's outcome.
_CLOSE_LUA = (
    EMIT_FUNCTION
    + """
if redis.call('HGET', KEYS[1], 'state') ~= 'waiting' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'answer', ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[4])
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
emit({KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, ARGV[6], ARGV[7], '0', ARGV[5])
return 1
"""
)

# KEYS: record, results. ARGV: tuid, verdict, answer JSON.
_TAKE_LUA = """
local f = redis.call('HMGET', KEYS[1], 'state', 'answer', 'taken')
if not f[1] then return 'unknown' end
if f[1] ~= ARGV[2] or f[2] ~= ARGV[3] then return 'forged' end
if f[3] then return 'again' end
redis.call('HSET', KEYS[1], 'taken', '1')
local closed = ARGV[2] == 'expired' or ARGV[2] == 'cancelled'
if not closed and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 'ended' end
return 'ok'
"""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ParkedCall(_Frozen):
    """What the machine parks: the call as it reached the machine and the gate's view."""

    call: ToolCall
    reason: str  # the gate's, as the person was asked
    gate: dict[str, Any]  # the gate's decision, for the audit line of the final verdict
    resolved_input: dict[str, Any] | None = None  # the input with its paths resolved
    asked_ms: int
    expires_ms: int  # the asked time plus the machine's wait, capped by the run deadline
    timeout_ms: int  # the call's own time, which starts when it is approved


class ParkedRecord(_Frozen):
    """A parked call as stored, with where it stands."""

    parked: ParkedCall
    state: ParkedState
    grace_ms: int
    answer: ApprovalAnswer | None = None
    deadline_ms: int | None = None  # the call's deadline, once approved
    taken: bool = False  # a machine has acted on the answer

    @property
    def call(self) -> ToolCall:
        return self.parked.call

    @property
    def wait_s(self) -> float:
        return (self.parked.expires_ms - self.parked.asked_ms) / 1000

    def hold_ms(self) -> int:
        """Until when the call's turn must wait for it: its expiry while it waits, its
        deadline once approved, each with the grace a machine has to report (0: none)."""
        if self.state == "waiting":
            return self.parked.expires_ms + self.grace_ms
        if self.state == "approved" and self.deadline_ms is not None:
            return self.deadline_ms + self.grace_ms
        return 0


def parse_record(fields: dict[str, str]) -> ParkedRecord | None:
    if "park" not in fields:
        return None
    answer, deadline = fields.get("answer"), fields.get("deadline_ms")
    return ParkedRecord(
        parked=ParkedCall.model_validate_json(fields["park"]),
        state=cast(ParkedState, fields["state"]),
        grace_ms=int(fields["grace_ms"]),
        answer=ApprovalAnswer.model_validate_json(answer) if answer else None,
        deadline_ms=int(deadline) if deadline else None,
        taken=bool(fields.get("taken")),
    )


def resolved_data(tool_use_id: str, answer: ApprovalAnswer) -> dict[str, Any]:
    """The data of an APPROVAL_RESOLVED event."""
    data: dict[str, Any] = {"tool_call_id": tool_use_id, "verdict": answer.verdict}
    data["by"] = answer.by
    if answer.reason is not None:
        data["reason"] = answer.reason
    if answer.input is not None:
        data["input"] = answer.input
    return data


class Approvals:
    def __init__(self, client: redis.Redis, keys: Keys, events: EventSink, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.events = events
        self.ttl_s = ttl_s
        self._park = client.register_script(_PARK_LUA)
        self._answer = client.register_script(_ANSWER_LUA)
        self._close = client.register_script(_CLOSE_LUA)
        self._take = client.register_script(_TAKE_LUA)

    def park(self, parked: ParkedCall, request: dict[str, Any], *, grace_ms: int) -> Parked:
        """Park the call and write its APPROVAL_REQUEST (`request`, the event's data)."""
        call = parked.call
        frame = self.events.frame(call.run_id, "APPROVAL_REQUEST", call.turn, request)
        status = self._park(
            keys=[
                self.keys.approval(call.run_id, call.tool_use_id),
                self.keys.parked(call.run_id),
                self.keys.turn(call.run_id, call.turn, "results"),
                self.keys.cancel(call.run_id),
                self.keys.deadlines,
                *frame.keys,
            ],
            args=[
                call.tool_use_id,
                parked.model_dump_json(),
                parked.expires_ms,
                parked.timeout_ms,
                grace_ms,
                call.run_deadline_ms,
                call.turn,
                self.ttl_s,
                approval_member(call.run_id, call.tool_use_id),
                turn_member(call.run_id, call.turn),
                parked.expires_ms + grace_ms,
                frame.maxlen,
                frame.head,
                frame.tail,
            ],
        )
        return cast(Parked, status)

    def load(self, run_id: str, tool_use_id: str) -> ParkedRecord | None:
        fields = cast(dict[str, str], self.redis.hgetall(self.keys.approval(run_id, tool_use_id)))
        return parse_record(fields)

    def of_run(self, run_id: str) -> list[ParkedRecord]:
        """Every call the run has parked, in no particular order."""
        ids = sorted(cast(set[str], self.redis.smembers(self.keys.parked(run_id))))
        pipe = self.redis.pipeline(transaction=False)
        for tool_use_id in ids:
            pipe.hgetall(self.keys.approval(run_id, tool_use_id))
        found = (parse_record(fields) for fields in pipe.execute())
        return [record for record in found if record is not None]

    def answer(
        self, record: ParkedRecord, answer: ApprovalAnswer, *, now_ms: int
    ) -> Refused | None:
        """A person's answer, taken once while the call waits; None when taken, else why
        not. Writes APPROVAL_RESOLVED with it."""
        status, _ = self._resolve(self._answer, record, answer, now_ms=now_ms)
        return None if status == "ok" else cast(Refused, status)

    def close(self, record: ParkedRecord, answer: ApprovalAnswer) -> bool:
        """Expire or cancel a waiting call, once; True when the caller is to record its
        outcome (False: it was no longer waiting, or already had an outcome)."""
        status, _ = self._resolve(self._close, record, answer, now_ms=None)
        return status == 1

    def _resolve(
        self, script: Any, record: ParkedRecord, answer: ApprovalAnswer, *, now_ms: int | None
    ) -> tuple[Any, Any]:
        call = record.call
        data = resolved_data(call.tool_use_id, answer)
        frame = self.events.frame(call.run_id, "APPROVAL_RESOLVED", call.turn, data)
        member = approval_member(call.run_id, call.tool_use_id)
        head = [call.tool_use_id, answer.verdict, answer.model_dump_json()]
        if now_ms is None:
            args = [*head, member, frame.maxlen, frame.head, frame.tail]
        else:
            turn = turn_member(call.run_id, call.turn)
            args = [*head, now_ms, member, turn, frame.maxlen, frame.head, frame.tail]
        result = script(keys=[*self._call_keys(call), self.keys.deadlines, *frame.keys], args=args)
        return (result[0], result[1]) if isinstance(result, list) else (result, None)

    def take(self, call: ToolCall, answer: ApprovalAnswer) -> Taken:
        """Claim the carrying out of `answer`: "ok" once, when the record holds it."""
        status = self._take(
            keys=self._call_keys(call),
            args=[call.tool_use_id, answer.verdict, answer.model_dump_json()],
        )
        return cast(Taken, status)

    def _call_keys(self, call: ToolCall) -> list[str]:
        return [
            self.keys.approval(call.run_id, call.tool_use_id),
            self.keys.turn(call.run_id, call.turn, "results"),
        ]
