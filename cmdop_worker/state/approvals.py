"""Parked calls: tool calls whose permission verdict is "ask", waiting for a person.

A parked call holds no worker thread and no Celery slot: it is two Redis hashes, each
change a Lua script that sees the call's state and acts at most once. The record
(`keys.approval`) is the machine's: the call as parked, its times, and who took the
answer. The verdict (`keys.verdict`) is the answerers': its state, the answer and a copy
of the call as it was when answered. They live apart so that Redis's ACL can let a
machine worker write its records but only read verdicts (`state.acl`): credentials
taken from a machine approve nothing, and a record changed after its answer changes
nothing, since the machine carries out the verdict's copy. Both are named by the
machine the call was sent to, so a machine writes only records of calls sent to it:
what a person is asked about a call is what its machine parked, whichever other
machine's credentials were taken (readers find it: `parked_index`). A record without a
verdict is waiting. Every time these scripts judge by is Redis's own clock (`TIME`), never a
caller's: a person's laptop, a machine or a coordinator whose clock is
off neither expires a call early nor lets one be answered late, nor shifts a deadline.

- `park` (the machine worker, on "ask"): the record (waiting, asked now, expiring
  after the machine's wait or at the run's deadline), the run's index of parked calls,
  the watchdog entry `approval:<run>:<tuid>` at the expiry, the turn's deadline entry
  pushed past that expiry (so the turn's watchdog does not time the call out while it
  waits), and the APPROVAL_REQUEST event. Refused when the call already has an outcome
  or the run has a cancel request.
- `answer` (the client): `waiting` → `approved` | `denied`, once, before the expiry,
  with APPROVAL_RESOLVED, and only on the record as the answering client read it (its
  fingerprint: a record changed since is refused "changed"). An approval starts the
  call's own deadline then (its timeout length, capped by the run's deadline) and
  pushes the turn's deadline past it. The watchdog entry moves to a grace later: it
  sends the carrying task again
  (`resend`) while the answer is not taken, so an answer whose task was never sent (a
  broker hiccup, the answering client killed) is carried out all the same.
- `close` (the coordinator's watchdog and cancel listener): `waiting` → `expired` |
  `cancelled`, once, with APPROVAL_RESOLVED; an expiry not yet due by Redis's clock is
  put back to its time.
- `take` (the machine worker given a `cmdop.tool` task carrying an answer): the task is
  acted on once, and only when the verdict holds that very answer, so a replayed or
  forged task alone runs nothing. The taker is stored: a later copy tells the process
  still carrying the call out from one that died doing so.

That carrying task is built and sent by `messages.send_answer`, the same for every
sender: this layer speaks Redis only.

Who calls it: `machine.worker` (park, take), `surfaces.answer` (load, answer), the
coordinator's `approvals` (close, resend, and what a turn's deadline must wait for).
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal, cast

import redis
from pydantic import BaseModel, ConfigDict

from cmdop_worker.core.event_data import ApprovalRequestData, ApprovalResolvedData
from cmdop_worker.models import ApprovalAnswer, ToolCall
from cmdop_worker.state import scripts
from cmdop_worker.state.approvals_lua import ANSWER_LUA, CLOSE_LUA, PARK_LUA, RESEND_LUA, TAKE_LUA
from cmdop_worker.state.events import EventSink
from cmdop_worker.state.keys import (
    Keys,
    approval_member,
    parked_member,
    turn_member,
)
from cmdop_worker.state.parked_index import filed_as, filed_calls, sent_to

ParkedState = Literal["waiting", "approved", "denied", "expired", "cancelled"]
Parked = Literal["parked", "answered", "again", "cancelled"]
# Why an answer was not taken: the call never parked, was answered, expired, was
# cancelled while it waited, or ended otherwise (its machine was lost).
# A "changed" record is not the one the person was shown.
Refused = Literal["no_request", "answered", "expired", "cancelled", "ended", "changed"]
Taken = Literal["ok", "unknown", "forged", "again", "ended"]


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
    fingerprint: str = ""  # of the record's call as read: an answer is to that one

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


def parse_record(fields: dict[str, str], verdict: dict[str, str]) -> ParkedRecord | None:
    """A parked call from its record and its verdict hash. Where it stands and its
    answer are the verdict's alone, and once answered so is the call (the copy taken
    then): what a machine writes into its record later counts for nothing."""
    if "park" not in fields:
        return None
    answer, deadline = verdict.get("answer"), verdict.get("deadline_ms")
    raw = verdict.get("park") or fields["park"]
    parked = ParkedCall.model_validate_json(raw)
    if "asked_ms" in fields:  # the wait as Redis's clock set it, not the machine's
        times = {"asked_ms": int(fields["asked_ms"]), "expires_ms": int(fields["expires_ms"])}
        parked = parked.model_copy(update=times)
    return ParkedRecord(
        parked=parked,
        state=cast(ParkedState, verdict.get("state", "waiting")),
        grace_ms=int(verdict.get("grace_ms") or fields["grace_ms"]),
        answer=ApprovalAnswer.model_validate_json(answer) if answer else None,
        deadline_ms=int(deadline) if deadline else None,
        taken=bool(fields.get("taken")),
        fingerprint=hashlib.sha1(fields["park"].encode()).hexdigest(),
    )


class Approvals:
    def __init__(self, client: redis.Redis, keys: Keys, events: EventSink, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.events = events
        self.ttl_s = ttl_s
        self._park = scripts.script(client, PARK_LUA)
        self._answer = scripts.script(client, ANSWER_LUA)
        self._close = scripts.script(client, CLOSE_LUA)
        self._take = scripts.script(client, TAKE_LUA)
        self._resend = scripts.script(client, RESEND_LUA)

    def park(
        self,
        parked: ParkedCall,
        request: ApprovalRequestData | dict[str, Any],
        *,
        grace_ms: int,
    ) -> Parked:
        """Park the call and write its APPROVAL_REQUEST (`request`, the event's data, or
        its JSON object as read from the stream, checked the same). Its wait,
        `expires_ms - asked_ms`, starts now by Redis's clock."""
        call = parked.call
        data = ApprovalRequestData.model_validate(request)
        frame = self.events.frame(call.run_id, call.turn, data)
        status = self._park(
            keys=[
                self.keys.approval(call.run_id, call.tool_use_id, call.machine),
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
                parked_member(call.machine, call.tool_use_id),
            ],
        )
        return cast(Parked, status)

    def load(
        self, run_id: str, tool_use_id: str, machine: str | None = None
    ) -> ParkedRecord | None:
        """The call's record, given the machine it was sent to or found by the run's
        index; None when there is none, or two and the run's state cannot tell."""
        filed = [machine] if machine else self._filed(run_id).get(tool_use_id, [])
        return self._one(run_id, self._read(run_id, [(m, tool_use_id) for m in filed]))

    def of_run(self, run_id: str) -> list[ParkedRecord]:
        """Every call the run has parked, in no particular order."""
        filed = self._filed(run_id)
        found = self._read(run_id, [(m, tuid) for tuid, ms in filed.items() for m in ms])
        each = [[r for r in found if r.call.tool_use_id == tuid] for tuid in filed]
        return [record for records in each if (record := self._one(run_id, records))]

    def _one(self, run_id: str, found: list[ParkedRecord]) -> ParkedRecord | None:
        """A call's record among those filed for its id: the one of the machine the
        call was sent to, when two machines filed one (None: the state cannot tell)."""
        if len(found) > 1:
            machine = sent_to(self.redis, self.keys, run_id, found[0].call.tool_use_id)
            found = [record for record in found if record.call.machine == machine]
        return found[0] if len(found) == 1 else None

    def _filed(self, run_id: str) -> dict[str, list[str]]:
        return filed_calls(cast(set[str], self.redis.smembers(self.keys.parked(run_id))))

    def _read(self, run_id: str, calls: list[tuple[str, str]]) -> list[ParkedRecord]:
        pipe = self.redis.pipeline(transaction=False)
        for machine, tool_use_id in calls:
            pipe.hgetall(self.keys.approval(run_id, tool_use_id, machine))
            pipe.hgetall(self.keys.verdict(run_id, tool_use_id, machine))
        both = pipe.execute()
        found = []
        for i, (machine, tool_use_id) in enumerate(calls):
            record = parse_record(both[2 * i], both[2 * i + 1])
            if record is not None and filed_as(record.call, run_id, tool_use_id, machine):
                found.append(record)
        return found

    def answer(self, record: ParkedRecord, answer: ApprovalAnswer) -> Refused | None:
        """A person's answer, taken once while the call waits (by Redis's clock); None
        when taken, else why not. Writes APPROVAL_RESOLVED with it; the caller sends
        the task that carries it out (`messages.send_answer`), the watchdog again if need be."""
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
        data = ApprovalResolvedData.of(call.tool_use_id, answer)
        frame = self.events.frame(call.run_id, call.turn, data)
        args: list[Any] = [call.tool_use_id, answer.verdict, answer.model_dump_json()]
        args.append(approval_member(call.run_id, call.tool_use_id))
        if person:
            args.append(turn_member(call.run_id, call.turn))
        args += [frame.maxlen, frame.head, frame.tail, self.ttl_s]
        if person:
            args.append(record.fingerprint)
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
            self.keys.approval(call.run_id, call.tool_use_id, call.machine),
            self.keys.turn(call.run_id, call.turn, "results"),
            self.keys.deadlines,
            self.keys.verdict(call.run_id, call.tool_use_id, call.machine),
        ]
