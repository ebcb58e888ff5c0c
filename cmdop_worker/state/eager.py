"""A turn's eagerly sent calls: what went out before its reply was complete.

While a reply streams, the coordinator sends each whole tool call on as its block
closes (`coordinator.eager`). Before each one goes out it stores, under the turn key
`eager`, the reply as far as it is whole (its blocks, in order), the calls sent so far
with their routes, and the usage reported so far. A turn executed again after its
executor died reads this record instead of asking the model again: the reply it stores
is the one the sent calls belong to, so nothing is sent twice and nothing is lost.

The write is one script: fenced by the turn's lease (a stale executor stores nothing
and sends nothing: `LeaseLost`) and refused while the run has a cancel request of any
channel, so no call starts eagerly once a cancel was asked for. It is read only by a
turn's later attempts, and expires with the turn's other keys (once the turn's dispatch
stored the whole reply, no attempt of the turn runs again).
"""

from __future__ import annotations

from typing import Any

import redis
from pydantic import BaseModel, ConfigDict

from cmdop_worker.errors import LeaseLost
from cmdop_worker.models import Usage
from cmdop_worker.state.fence import FENCE_FUNCTION, write_fence
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.scripts import run_script

# Stores the record unless fenced out or the run has a cancel request. Returns 1
# stored, 0 lease lost, -1 the run has a cancel.
_STORE_LUA = (
    FENCE_FUNCTION
    + """
local record_key, lock_key, attempts_key, cancel_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local record, token, attempt, lease_ms, ttl_s = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if not fenced(lock_key, attempts_key, token, attempt, lease_ms) then return 0 end
if redis.call('EXISTS', cancel_key) == 1 then return -1 end
redis.call('SET', record_key, record, 'EX', ttl_s)
return 1
"""
)


class SentCall(BaseModel):
    """A call sent on eagerly, with the route it was sent by."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool_use_id: str
    tool: str
    machine: str
    input: dict[str, Any]
    deadline_ms: int


class EagerReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    content: list[dict[str, Any]]  # the reply's whole blocks, as they would be stored
    sent: list[SentCall]
    usage: Usage = Usage()
    model: str | None = None
    steers_applied: int = 0  # the run's steering messages the reply was written after


class EagerRecords:
    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s

    def store(self, run_id: str, turn: int, record: EagerReply) -> bool:
        """Store the record before its latest call goes out; False when the run has a
        cancel request (send nothing more). Raises `LeaseLost` when the turn is no
        longer this executor's."""
        lock_key = self.keys.turn(run_id, turn, "lock")
        fence = write_fence(run_id, unfenced_lock=lock_key, refused="nothing sent")
        code = run_script(
            self.redis,
            _STORE_LUA,
            keys={
                "record": self.keys.turn(run_id, turn, "eager"),
                **fence.keys,
                "cancel": self.keys.cancel(run_id),
            },
            args={"record": record.model_dump_json(), **fence.args, "ttl_s": self.ttl_s},
        )
        if int(code) == 0:
            raise LeaseLost(f"run {run_id}: turn {turn} lost its lease; nothing sent")
        return int(code) > 0

    def load(self, run_id: str, turn: int) -> EagerReply | None:
        raw = self.redis.get(self.keys.turn(run_id, turn, "eager"))
        return None if raw is None else EagerReply.model_validate_json(raw)
