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

A fan-out's copies may go out in batches (`core.fanout.batches`, the request's
`serial`): `store_batches` keeps, before the turn opens, each fan-out's first batch as
the copies out (`batch:<call>:current`, a set) and the batches to come
(`batch:<call>:queue`), with each waiting copy's `QueuedCall` in `calls`. The script
that records the last outcome of the batch out hands the next batch to its writer to
send (`HandedBatch`), exactly once, with the same resend entry and deadline cover as a
sequential turn's next call; handed out under a cancel, it is answered, never sent.

A call's TOOL_START written with its outcome (a call answered without starting) is
written only when no start was marked, so no call gets two.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import redis

from cmdop_worker.core.fanout import parent_id
from cmdop_worker.errors import LeaseLost
from cmdop_worker.models import CancelRequest, ToolOutcome
from cmdop_worker.state.barrier_lua import OPEN_TURN_LUA, RECORD_LUA, START_CALL_LUA
from cmdop_worker.state.connect import now_ms
from cmdop_worker.state.events import Frame
from cmdop_worker.state.fence import WriteFence, write_fence
from cmdop_worker.state.keys import Keys, advance_member, turn_member
from cmdop_worker.state.queued import QueuedCall
from cmdop_worker.state.records import RunState
from cmdop_worker.state.scripts import run_script

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


@dataclass(frozen=True)
class HandedBatch:
    """A fan-out's next batch, handed out to the writer of the last outcome before it."""

    calls: tuple[QueuedCall, ...]  # with their deadlines counted from the hand-out
    cancel: CancelRequest | None = None  # the run's: answer the copies, never send them


class Barrier:
    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s

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
        lock_key = self.keys.turn(run_id, turn, "lock")
        fence = WriteFence(lock_key)
        if save is not None:
            fence = write_fence(run_id, unfenced_lock=lock_key, refused="not dispatched")
        next_member, next_due_ms = self._next_entry(run_id, turn)
        code = run_script(
            self.redis,
            OPEN_TURN_LUA,
            keys={
                **self._turn_keys(run_id, turn),
                "state": self.keys.state(run_id),
                **fence.keys,
                **self._sequence_keys(run_id, turn),
            },
            args={
                "expected": expected,
                "ttl_s": self.ttl_s,
                "next_turn_member": next_member,
                "next_turn_due_ms": next_due_ms,
                "state": save.model_dump_json() if save is not None else "",
                **fence.args,
                "first_call": sequence[0].tool_use_id if sequence else "",
                "call_count": len(sequence),
            },
            more_args=[
                *(part for q in sequence for part in (q.tool_use_id, q.model_dump_json())),
                *(part for member, due in (schedule or {}).items() for part in (member, due)),
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
    ) -> tuple[Recorded, Handed | HandedBatch | None]:
        """Store an outcome once, writing `events` with it (and first `start`, the
        call's TOOL_START, unless the call was marked started); returns with it the next
        call of a sequential turn when this one was out, or a fan-out's next batch when
        this copy ended the batch out: the caller is to send it (to answer it, given the
        run's cancel request)."""
        events = [start, *events] if start is not None else list(events)
        now = now_ms()
        next_member, next_due_ms = self._next_entry(run_id, turn)
        code, handed, cancel, batch = run_script(
            self.redis,
            RECORD_LUA,
            keys={
                **self._turn_keys(run_id, turn),
                **self._sequence_keys(run_id, turn),
                "started": self.keys.tool_started(run_id, outcome.tool_use_id),
                "cancel": self.keys.cancel(run_id),
                **self._batch_keys(run_id, turn, outcome.tool_use_id),
            },
            args={
                "tool_use_id": outcome.tool_use_id,
                "outcome": outcome.model_dump_json(),
                "ttl_s": self.ttl_s,
                "next_turn_member": next_member,
                "next_turn_due_ms": next_due_ms,
                "event_maxlen": events[0].maxlen if events else 0,
                "first_is_start": "1" if start is not None else "0",
                "resend_member": advance_member(run_id, turn),
                "resend_due_ms": now + ADVANCE_GRACE_MS,
                "now_ms": now,
                "turn_member": turn_member(run_id, turn),
            },
            more_keys=events[0].keys if events else (),
            more_args=[part for event in events for part in (event.head, event.tail)],
        )
        recorded = {1: Recorded.ADVANCE, 0: Recorded.STORED}.get(int(code), Recorded.DUPLICATE)
        request = None if cancel is None else CancelRequest.model_validate_json(cancel)
        if batch:
            calls = [QueuedCall.model_validate_json(raw) for raw in batch if raw is not None]
            if request is None:
                calls = [queued.handed_out(now) for queued in calls]
            return recorded, HandedBatch(tuple(calls), request)
        if handed is None:
            return recorded, None
        queued = QueuedCall.model_validate_json(handed)
        if cancel is None:
            return recorded, Handed(queued.handed_out(now))
        return recorded, Handed(queued, CancelRequest.model_validate_json(cancel))

    def hand_out_again(self, run_id: str, turn: int, queued: QueuedCall) -> QueuedCall:
        """The call out now, as re-sent by recovery (its sender died): its deadline
        counted from now, and the turn's deadline entry pushed past it."""
        again = queued.handed_out(now_ms())
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
        """Mark a call started by `holder` and write its TOOL_START, in one step with
        checking that it has no outcome yet (so a watchdog answer and a late start cannot
        both happen), no cancel to honour at once and, given `call_deadline_passed`, no
        start past the call's own deadline (LATE). Returns how the call stands and with
        it: who started it before (AGAIN), the cancel request's JSON (CANCELLED), else
        ''. (An operation cancel does not stop a call: the loop's next boundary
        honours it.) First of all, the message's `digest` must be what its sender
        recorded for the call to `machine` (`state.sent`): else UNSENT, nothing done
        (no digest: a coordinator's own tool, which no message started)."""
        status, detail = run_script(
            self.redis,
            START_CALL_LUA,
            keys={
                "results": self.keys.turn(run_id, turn, "results"),
                "started": self.keys.tool_started(run_id, tool_use_id),
                "cancel": self.keys.cancel(run_id),
            },
            args={
                "tool_use_id": tool_use_id,
                "holder": holder,
                "ttl_s": self.ttl_s,
                "run_deadline_passed": "1" if deadline_passed else "0",
                "event_maxlen": start_event.maxlen,
                "event_head": start_event.head,
                "event_tail": start_event.tail,
                "call_deadline_passed": "1" if call_deadline_passed else "0",
                "digest": digest,
            },
            # The event keys, then the call's sent record (`sent_key`).
            more_keys=[*start_event.keys, self.keys.sent(run_id, tool_use_id, machine or "-")],
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
        sequence = self._sequence_keys(run_id, turn)
        self.redis.delete(sequence["current"], sequence["queue"])

    def store_batches(
        self,
        run_id: str,
        turn: int,
        plan: Mapping[str, Sequence[Sequence[str]]],
        waiting: Sequence[QueuedCall],
    ) -> None:
        """Keep a turn's batched fan-outs (`plan`: call -> its batches of copy ids), the
        first batch of each out, the copies of the others `waiting` in `calls`."""
        pipe = self.redis.pipeline(transaction=True)
        calls_key = self.keys.turn(run_id, turn, "calls")
        for queued in waiting:
            pipe.hset(calls_key, queued.tool_use_id, queued.model_dump_json())
        pipe.expire(calls_key, self.ttl_s)
        for call, chain in plan.items():
            keys = self._batch_keys(run_id, turn, call)
            pipe.delete(keys["batch_out"], keys["batch_queue"])
            pipe.sadd(keys["batch_out"], *chain[0])
            pipe.rpush(keys["batch_queue"], *(json.dumps(list(batch)) for batch in chain[1:]))
            pipe.expire(keys["batch_out"], self.ttl_s)
            pipe.expire(keys["batch_queue"], self.ttl_s)
        pipe.execute()

    def batch_waiting(self, run_id: str, turn: int, calls: Sequence[str]) -> set[str]:
        """The copies among `calls` that wait for a batch before theirs (not sent yet)."""
        parents = sorted({parent_id(c) for c in calls if parent_id(c) != c})
        if not parents:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for call in parents:
            pipe.lrange(self._batch_keys(run_id, turn, call)["batch_queue"], 0, -1)
        return {c for chain in pipe.execute() for raw in chain for c in json.loads(raw)}

    def in_batch_out(self, run_id: str, turn: int, tool_use_id: str) -> bool:
        """Whether a copy is in its fan-out's batch out now."""
        key = self._batch_keys(run_id, turn, tool_use_id)["batch_out"]
        return bool(self.redis.sismember(key, tool_use_id))

    def _batch_keys(self, run_id: str, turn: int, tool_use_id: str) -> dict[str, str]:
        # Named `...:current` and `...:queue`, as a sequential turn's, so a machine's
        # grants on those (`state.acl`) cover them.
        call = parent_id(tool_use_id)
        return {
            "batch_out": self.keys.turn(run_id, turn, f"batch:{call}:current"),
            "batch_queue": self.keys.turn(run_id, turn, f"batch:{call}:queue"),
        }

    def _turn_keys(self, run_id: str, turn: int) -> dict[str, str]:
        return {
            "results": self.keys.turn(run_id, turn, "results"),
            "expected": self.keys.turn(run_id, turn, "expected"),
            "advanced": self.keys.turn(run_id, turn, "advanced"),
            "deadlines": self.keys.deadlines,
        }

    def _sequence_keys(self, run_id: str, turn: int) -> dict[str, str]:
        return {part: self.keys.turn(run_id, turn, part) for part in ("current", "queue", "calls")}

    def _next_entry(self, run_id: str, turn: int) -> tuple[str, int]:
        return advance_member(run_id, turn + 1), now_ms() + ADVANCE_GRACE_MS


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
