"""The record of each machine call as its sender sent it, and the check against it.

A machine runs only calls the control plane sent it. Every sender of a machine call —
the turn's dispatch (eager or not), recovery re-sending one, a sequential turn's
dispatch for all its calls at once — first writes `sent:<machine>:<run>:<tuid>`: the
digest of what the call is (`call_digest`). Machines may read their own records and
write none (`state.acl`), so a message pushed onto a machine's queue by anyone else
(another machine's credentials, a tool that reached Redis) names a call with no record
or one whose digest differs, and the machine refuses it before anything starts: the
check is part of the start script (`barrier.start_call`), no extra round trip.

The digest covers what decides what runs: the run, the turn, the call id, the machine,
the tool, its input and the run's deadline. Not the call's own deadline: a sequential
turn's call gets it as it is handed out, by whoever hands it out (a machine too), from
the timeout stored with the turn by the coordinator.

The answer to a parked call needs no record of its own: the machine runs the copy it
parked itself, and only the answer an answerer wrote (`state.approvals`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import redis

from cmdop_worker.models import ToolCall
from cmdop_worker.state.keys import Keys


def call_digest(call: ToolCall) -> str:
    """The digest of a call's identity and content, the same on both sides of the queue
    (canonical JSON: sorted keys, no spaces, as the message's own JSON decodes)."""
    shown = {
        "run_id": call.run_id,
        "turn": call.turn,
        "tool_use_id": call.tool_use_id,
        "machine": call.machine,
        "tool": call.tool,
        "input": call.input,
        "run_deadline_ms": call.run_deadline_ms,
    }
    text = json.dumps(shown, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def mark_sent(client: redis.Redis, keys: Keys, calls: Iterable[ToolCall], *, ttl_s: int) -> None:
    """Record the calls as sent, in one round trip; before they are published, so a
    machine never sees a call it has no record of."""
    pipe = client.pipeline(transaction=False)
    for call in calls:
        key = keys.sent(call.run_id, call.tool_use_id, call.machine)
        pipe.set(key, call_digest(call), ex=max(ttl_s, 1))
    if pipe:
        pipe.execute()
