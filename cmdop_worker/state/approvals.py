"""Parked calls: tool calls whose permission verdict is "ask", waiting for a person.

A parked call holds no worker thread and no Celery slot: all of it is one Redis hash
(`keys.approval`), written in one step, each change a Lua script that sees the call's
state and acts at most once. Every time these scripts judge by is Redis's own clock
(`TIME`), never a caller's: a person's laptop, a machine or a coordinator whose clock is
off neither expires a call early nor lets one be answered late, nor shifts a deadline.

- `park` (the machine worker, on "ask"): the record (state `waiting`, asked now, expiring
  after the machine's wait or at the run's deadline), the run's index of parked calls,
  the watchdog entry `approval:<run>:<tuid>` at the expiry, the turn's deadline entry
  pushed past that expiry (so the turn's watchdog does not time the call out while it
  waits), and the APPROVAL_REQUEST event. Refused when the call already has an outcome
  or the run has a cancel request.
- `answer` (the client): `waiting` → `approved` | `denied`, once, before the expiry,
  with APPROVAL_RESOLVED. An approval starts the call's own deadline then (its timeout
  length, capped by the run's deadline) and pushes the turn's deadline past it. The
  watchdog entry moves to a grace later: it sends the carrying task again
  (`resend`) while the answer is not taken, so an answer whose task was never sent (a
  broker hiccup, the answering client killed) is carried out all the same.
- `close` (the coordinator's watchdog and cancel listener): `waiting` → `expired` |
  `cancelled`, once, with APPROVAL_RESOLVED; an expiry not yet due by Redis's clock is
  put back to its time.
- `take` (the machine worker given a `cmdop.tool` task carrying an answer): the task is
  acted on once, and only when the record holds that very answer, so a replayed or
  forged task alone runs nothing. The taker is stored: a later copy tells the process
  still carrying the call out from one that died doing so.

`send_answer` builds and sends that carrying task, the same for every sender.

Who calls it: `machine.worker` (park, take), `surfaces.answer` (load, answer,
send_answer), the coordinator's `approvals` (close, resend, send_answer, and what a
turn's deadline must wait for).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, cast

import redis
from pydantic import BaseModel, ConfigDict

from cmdop_worker.models import ApprovalAnswer, ToolCall
from cmdop_worker.state.events import EMIT_FUNCTION, EventSink
from cmdop_worker.state.keys import Keys, approval_member, machine_queue, turn_member

ParkedState = Literal["waiting", "approved", "denied", "expired", "cancelled"]
Parked = Literal["parked", "answered", "again", "cancelled"]
# Why an answer was not taken: the call never parked, was answered, expired, was
# cancelled while it waited, or ended otherwise (its machine was lost).
Refused = Literal["no_request", "answered", "expired", "cancelled", "ended"]
Taken = Literal["ok", "unknown", "forged", "again", "ended"]
# A carrying task still queued that long after it was sent is dropped unrun: by then the
# watchdog has sent a newer one, or the call has an outcome without it.
ANSWER_TASK_EXPIRES_S = 3_600

# Redis's clock in ms, for every script that judges a time.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: record, index, results, cancel, deadlines, the run's four event keys.
# ARGV: tuid, park JSON, wait, timeout, grace, run deadline, turn, ttl, approval
# member, turn member, maxlen, APPROVAL_REQUEST's head and tail.
_PARK_LUA = (
    EMIT_FUNCTION
    + _NOW
    + """
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 'answered' end
if redis.call('EXISTS', KEYS[1]) == 1 then return 'again' end
if redis.call('EXISTS', KEYS[4]) == 1 then return 'cancelled' end
local expires = math.min(now + tonumber(ARGV[3]), tonumber(ARGV[6]))
local asked, expiry = string.format('%.0f', now), string.format('%.0f', expires)
redis.call('HSET', KEYS[1], 'park', ARGV[2], 'asked_ms', asked, 'expires_ms', expiry,
  'timeout_ms', ARGV[4], 'grace_ms', ARGV[5], 'run_deadline_ms', ARGV[6], 'turn', ARGV[7],
  'state', 'waiting')
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[5], expiry, ARGV[9])
redis.call('ZADD', KEYS[5], 'GT', string.format('%.0f', expires + tonumber(ARGV[5])), ARGV[10])
emit({KEYS[6], KEYS[7], KEYS[8], KEYS[9]}, ARGV[12], ARGV[13], '0', ARGV[11])
return 'parked'
"""
)

# KEYS: record, results, deadlines, the run's four event keys. ARGV: tuid, verdict,
# answer JSON, approval member, turn member, maxlen, APPROVAL_RESOLVED's head, tail.
_ANSWER_LUA = (
    EMIT_FUNCTION
    + _NOW
    + """
local f = redis.call('HMGET', KEYS[1], 'state', 'expires_ms', 'timeout_ms', 'run_deadline_ms',
  'grace_ms')
if not f[1] then return {'no_request', ''} end
if f[1] == 'approved' or f[1] == 'denied' then return {'answered', ''} end
if f[1] ~= 'waiting' then return {f[1], ''} end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {'ended', ''} end
if now >= tonumber(f[2]) then return {'expired', ''} end
local deadline = ''
if ARGV[2] == 'approved' then
  local ms = math.min(now + tonumber(f[3]), tonumber(f[4]))
  deadline = string.format('%.0f', ms)
  redis.call('ZADD', KEYS[3], 'GT', string.format('%.0f', ms + tonumber(f[5])), ARGV[5])
end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'answer', ARGV[3], 'deadline_ms', deadline,
  'answered_at_ms', string.format('%.0f', now))
redis.call('ZADD', KEYS[3], string.format('%.0f', now + tonumber(f[5])), ARGV[4])
emit({KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, ARGV[7], ARGV[8], '0', ARGV[6])
return {'ok', deadline}
"""
)

# KEYS: record, results, deadlines, the run's four event keys. ARGV: tuid, verdict,
# answer JSON, approval member, maxlen, APPROVAL_RESOLVED's head and tail. Returns 1
# when the caller is to record the call's outcome.
_CLOSE_LUA = (
    EMIT_FUNCTION
    + _NOW
    + """
local f = redis.call('HMGET', KEYS[1], 'state', 'expires_ms')
if f[1] ~= 'waiting' then return 0 end
if ARGV[2] == 'expired' and now < tonumber(f[2]) then
  redis.call('ZADD', KEYS[3], f[2], ARGV[4])
  return 0
end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'answer', ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[4])
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
emit({KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, ARGV[6], ARGV[7], '0', ARGV[5])
return 1
"""
)

# KEYS: record, results, deadlines. ARGV: tuid, verdict, answer JSON, taker, approval
# member. Returns the status and, when it was taken before, by whom.
_TAKE_LUA = """
local f = redis.call('HMGET', KEYS[1], 'state', 'answer', 'taken')
if not f[1] then return {'unknown', ''} end
if f[1] ~= ARGV[2] or f[2] ~= ARGV[3] then return {'forged', ''} end
local closed = ARGV[2] == 'expired' or ARGV[2] == 'cancelled'
local ended = redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
if f[3] then
  if closed or ended then return {'ended', f[3]} end
  return {'again', f[3]}
end
redis.call('HSET', KEYS[1], 'taken', ARGV[4])
redis.call('ZREM', KEYS[3], ARGV[5])
if not closed and ended then return {'ended', ''} end
return {'ok', ''}
"""

# KEYS: record, results, deadlines. ARGV: tuid, approval member. 1 when the answer's
# task is to be sent again (answered, not taken, no outcome): the entry is put off by
# the time since the answer (at least a grace), so a busy machine's queue gets few.
_RESEND_LUA = (
    _NOW
    + """
local f = redis.call('HMGET', KEYS[1], 'state', 'taken', 'answered_at_ms', 'grace_ms')
if (f[1] ~= 'approved' and f[1] ~= 'denied') or f[2] then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
local gap = math.max(tonumber(f[4]), now - tonumber(f[3] or now))
redis.call('ZADD', KEYS[3], string.format('%.0f', now + gap), ARGV[2])
return 1
"""
)


class TaskSender(Protocol):
    """What sends a Celery task: the app of a client or of a worker."""

    def send_task(self, name: str, *args: Any, **options: Any) -> Any: ...


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
    parked = ParkedCall.model_validate_json(fields["park"])
    if "asked_ms" in fields:  # the wait as Redis's clock set it, not the machine's
        times = {"asked_ms": int(fields["asked_ms"]), "expires_ms": int(fields["expires_ms"])}
        parked = parked.model_copy(update=times)
    return ParkedRecord(
        parked=parked,
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
        self._resend = client.register_script(_RESEND_LUA)

    def park(self, parked: ParkedCall, request: dict[str, Any], *, grace_ms: int) -> Parked:
        """Park the call and write its APPROVAL_REQUEST (`request`, the event's data).
        Its wait, `expires_ms - asked_ms`, starts now by Redis's clock."""
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
                parked.expires_ms - parked.asked_ms,
                parked.timeout_ms,
                grace_ms,
                call.run_deadline_ms,
                call.turn,
                self.ttl_s,
                approval_member(call.run_id, call.tool_use_id),
                turn_member(call.run_id, call.turn),
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

    def answer(self, record: ParkedRecord, answer: ApprovalAnswer) -> Refused | None:
        """A person's answer, taken once while the call waits (by Redis's clock); None
        when taken, else why not. Writes APPROVAL_RESOLVED with it; the caller sends
        the task that carries it out (`send_answer`), the watchdog again if need be."""
        status, _ = self._resolve(self._answer, record, answer, person=True)
        return None if status == "ok" else cast(Refused, status)

    def close(self, record: ParkedRecord, answer: ApprovalAnswer) -> bool:
        """Expire or cancel a waiting call, once; True when the caller is to record its
        outcome (False: it was no longer waiting, already had an outcome, or its expiry
        is not due yet by Redis's clock, and its entry is put back to it)."""
        status, _ = self._resolve(self._close, record, answer, person=False)
        return status == 1

    def _resolve(
        self, script: Any, record: ParkedRecord, answer: ApprovalAnswer, *, person: bool
    ) -> tuple[Any, Any]:
        call = record.call
        data = resolved_data(call.tool_use_id, answer)
        frame = self.events.frame(call.run_id, "APPROVAL_RESOLVED", call.turn, data)
        args: list[Any] = [call.tool_use_id, answer.verdict, answer.model_dump_json()]
        args.append(approval_member(call.run_id, call.tool_use_id))
        if person:
            args.append(turn_member(call.run_id, call.turn))
        args += [frame.maxlen, frame.head, frame.tail]
        result = script(keys=[*self._call_keys(call), *frame.keys], args=args)
        return (result[0], result[1]) if isinstance(result, list) else (result, None)

    def take(self, call: ToolCall, answer: ApprovalAnswer, *, taker: str) -> tuple[Taken, str]:
        """Claim the carrying out of `answer` for `taker`: "ok" once, when the record
        holds it. With "again" (taken, no outcome yet) and "ended", who took it."""
        status, holder = self._take(
            keys=self._call_keys(call),
            args=[
                call.tool_use_id,
                answer.verdict,
                answer.model_dump_json(),
                taker,
                approval_member(call.run_id, call.tool_use_id),
            ],
        )
        return cast(Taken, status), cast(str, holder)

    def resend(self, record: ParkedRecord) -> bool:
        """True when the answer's carrying task is to be sent again: answered, not
        taken, no outcome. Its watchdog entry is then put off to the next look."""
        call = record.call
        due = self._resend(
            keys=self._call_keys(call),
            args=[call.tool_use_id, approval_member(call.run_id, call.tool_use_id)],
        )
        return due == 1

    def _call_keys(self, call: ToolCall) -> list[str]:
        return [
            self.keys.approval(call.run_id, call.tool_use_id),
            self.keys.turn(call.run_id, call.turn, "results"),
            self.keys.deadlines,
        ]


def send_answer(sender: TaskSender, call: ToolCall, answer: ApprovalAnswer) -> None:
    """Send the `cmdop.tool` task that carries `answer` to the call's machine. Sent
    again while it is not taken, each copy is the same task: the machine acts on one
    (`take`)."""
    carried = call.model_copy(update={"approval": answer})
    sender.send_task(
        "cmdop.tool",
        kwargs={"call": carried.model_dump(mode="json")},
        queue=machine_queue(call.machine),
        task_id=f"{call.run_id}.{call.tool_use_id}.{answer.verdict}",
        expires=ANSWER_TASK_EXPIRES_S,
        kwargsrepr=repr({"run_id": call.run_id, "tool": call.tool, "verdict": answer.verdict}),
    )
