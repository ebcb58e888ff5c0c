"""A machine's Redis credentials cannot change what a person is asked about another
machine's call (`state.approvals`, `state.acl`), on a real redis-server with the
fleet's machine workers logged in as the ACL users `cmdop-worker acl` prints.

Machine acl-b parks a call for a person (`touch <original>`). Holding acl-a's
credentials, an attacker then tries to make the person approve something else
(`touch <swapped>`) and acl-b run it: rewrite acl-b's parked record, in place or by
the park script; file a record of its own for the same call id in the run's index;
write an APPROVAL_REQUEST showing the swapped command. Each write into acl-b's
records is refused (NOPERM). The event it can write (every machine writes a run's
events), but an answer to what it showed is refused as "changed" (chat answers what it
showed). The person approves the call by its id, as the client does; acl-b runs the
original command, and the swapped one's marker never appears.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from cmdop_worker.errors import ApprovalNotPending
from cmdop_worker.state.approvals import Approvals, ParkedCall
from cmdop_worker.state.connect import now_ms
from cmdop_worker.state.events import EventSink
from cmdop_worker.state.keys import parked_member

from .test_redis_acl import (  # noqa: F401  (acl: the fixture, a fleet of ACL users)
    KEYS,
    REFUSED,
    AclFleet,
    acl,
    command,
    events_until,
    reply,
    tool_ends,
)

pytestmark = pytest.mark.integration


def swapped(park_json: str, command: str) -> ParkedCall:
    """The parked call with another command: what the attacker wants approved."""
    parked = ParkedCall.model_validate_json(park_json)
    call = parked.call.model_copy(update={"input": {**parked.call.input, "command": command}})
    return parked.model_copy(update={"call": call, "resolved_input": None})


def test_one_machine_cannot_change_what_is_asked_about_anothers_call(
    acl: AclFleet,  # noqa: F811  (the fixture, imported above)
    tmp_path: Path,
) -> None:
    original, evil = tmp_path / "original", tmp_path / "swapped"
    run = acl.submit([[command("acl-b", f"touch {original}")], reply("over")])
    asked = events_until(run, lambda e: e.type == "APPROVAL_REQUEST")
    call_id, rid = asked.data["tool_call_id"], run.run_id
    record_key = KEYS.approval(rid, call_id, "acl-b")
    # What the attacker writes: the real record with the command swapped (read here
    # with the coordinator's credentials: a grant that let it write would let it read).
    fake = swapped(acl.client.redis.hget(record_key, "park") or "", f"touch {evil}")
    thief = acl.as_machine("acl-a")
    events = EventSink(thief, KEYS, maxlen=1000, ttl_s=600, clock_ms=now_ms)
    approvals = Approvals(thief, KEYS, events, ttl_s=600)
    results: dict[str, str] = {}
    writes: dict[str, Any] = {
        "rewrite the record": lambda: thief.hset(record_key, "park", fake.model_dump_json()),
        "park over it": lambda: approvals.park(fake, asked.data, grace_ms=1000),
        "read the verdict": lambda: thief.hgetall(KEYS.verdict(rid, call_id, "acl-b")),
    }
    for name, write in writes.items():
        try:
            write()
            results[name] = "went through"
        except redis.ResponseError as exc:
            results[name] = "refused" if _refused(exc) else str(exc)
    # Its own records it may write: one for the same call id, filed in the run's index.
    own = fake.model_copy(update={"call": fake.call.model_copy(update={"machine": "acl-a"})})
    thief.hset(KEYS.approval(rid, call_id, "acl-a"), "park", own.model_dump_json())
    thief.hset(KEYS.approval(rid, call_id, "acl-a"), mapping=_times(own))
    thief.sadd(KEYS.parked(rid), parked_member("acl-a", call_id))
    # Events are every run's to write: a request showing the swapped command.
    shown = {**asked.data, "input": fake.call.input}
    events.emit(rid, "APPROVAL_REQUEST", 1, shown)

    # An answer to what was shown is to that: the forged request approves nothing.
    with pytest.raises(ApprovalNotPending) as changed:
        run.approve(call_id, approve=True, by="ann", shown=shown)
    assert changed.value.why == "changed"
    assert acl.client.redis.exists(KEYS.verdict(rid, call_id, "acl-b")) == 0
    request = run.approve(call_id, approve=True, by="ann", shown=asked.data)
    result = run.wait(timeout=60)
    assert result.status == "done", result
    assert not evil.exists()
    assert original.exists()
    assert request.machine == "acl-b" and request.input["command"] == f"touch {original}"
    (end,) = tool_ends(run).values()
    assert (end["machine"], end["status"]) == ("acl-b", "ok")
    assert results == dict.fromkeys(writes, "refused")


def _refused(exc: redis.ResponseError) -> bool:
    import re

    return re.search(REFUSED, str(exc)) is not None


def _times(parked: ParkedCall) -> dict[str, str]:
    """The rest of a record's fields, as the park script writes them."""
    return {
        "asked_ms": str(now_ms()),
        "expires_ms": str(now_ms() + 300_000),
        "timeout_ms": str(parked.timeout_ms),
        "grace_ms": "1000",
        "run_deadline_ms": str(parked.call.run_deadline_ms),
        "turn": str(parked.call.turn),
    }
