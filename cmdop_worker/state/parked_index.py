"""Where a parked call's record is: the run's index of parked calls, read with care.

A parked record is named by the machine its call was sent to (`Keys.approval`), so a
machine's ACL writes only its own machine's records. A reader that does not know the
machine (a person's answer, the watchdog, a cancel, liveness) finds it in the run's
index (`Keys.parked`, members `parked_member`). Any machine may add to that index, so
it only says where to look: a record counts only where it names the very call it is
filed under (`filed_as`), and when two machines' records are filed for one id, the
machine the coordinator sent the call to (the run's state, which no machine reads or
writes) decides (`sent_to`).

Used by `approvals` only. Pure but for `sent_to`, which reads the run's state.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from cmdop_worker.models import ToolCall
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.records import parse_state


def filed_calls(members: Iterable[str]) -> dict[str, list[str]]:
    """The index's members as each parked call's id with the machines filed for it."""
    filed: dict[str, list[str]] = {}
    for member in sorted(members):
        machine, _, tool_use_id = member.partition(":")  # a machine name holds no ':'
        filed.setdefault(tool_use_id, []).append(machine)
    return filed


def filed_as(call: ToolCall, run_id: str, tool_use_id: str, machine: str) -> bool:
    """Whether a record names the call it is filed under: a record says its machine by
    where it is, so no other machine's record can be taken for it."""
    return (call.run_id, call.tool_use_id, call.machine) == (run_id, tool_use_id, machine)


def sent_to(client: redis.Redis, keys: Keys, run_id: str, tool_use_id: str) -> str | None:
    """The machine the coordinator sent the call to, while its turn is in flight."""
    state = parse_state(client.get(keys.state(run_id)))
    calls = state.awaiting if state is not None else []
    return next((c.machine for c in calls if c.tool_use_id == tool_use_id), None)
