"""An answer to a parked call reaches its machine, and only Redis's clock judges it.

Through real workers: a machine `relay` of the session fleet under the parked-approvals
policy (every call asks), waiting 300 s for an answer. Each call is given a long
timeout of its own, so a call nobody carries out would hold its run for minutes, far
past every wait here:

- an answer whose carrying task was never sent (the answering client's broker refuses,
  or the client was killed between writing the answer and sending it) still stands,
  and the coordinator's watchdog sends the task: the call runs;
- an answer taken by a process of the machine that is gone (it died carrying it out)
  is answered "lost" by the copy the broker delivers again, at once; a copy arriving
  while this very process still carries the call out changes nothing;
- a client whose clock is a day off answers a call that waits, and the approved call
  gets its own full time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.messages import send_answer
from cmdop_worker.models import ApprovalAnswer
from cmdop_worker.state.approvals import ParkedRecord, parse_record
from cmdop_worker.state.connect import now_ms
from cmdop_worker.state.keys import machine_queue
from cmdop_worker.surfaces.client import Client

from .test_parked_approvals import POLICY, asked, command, ended, of, reply

MACHINE = "relay"
LONG_MS = 300_000  # the call's own timeout: far past every wait of these tests
DAY_MS = 86_400_000


@pytest.fixture(scope="module", autouse=True)
def relay(fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    policy = tmp_path_factory.mktemp("relay") / "policy.toml"
    policy.write_text(POLICY)
    extra = {
        "CMDOP_PERMISSION_MODE": "default",
        "CMDOP_POLICY_FILE": str(policy),
        "CMDOP_APPROVAL_TIMEOUT_S": "300",
    }
    fleet.start_machine(MACHINE, extra)
    try:
        fleet.wait_ready([MACHINE], timeout_s=60)
        yield
    finally:
        fleet.workers.pop(MACHINE).stop()


def loaded(client: Client, run_id: str, call_id: str) -> ParkedRecord | None:
    fields = client.redis.hgetall(client.keys.approval(run_id, call_id, MACHINE))
    return parse_record(fields, client.redis.hgetall(client.keys.verdict(run_id, call_id, MACHINE)))


def approval_entry(client: Client, run_id: str, call_id: str) -> float | None:
    return client.redis.zscore(client.keys.deadlines, f"approval:{run_id}:{call_id}")


class Killed:
    """The answering client's Celery app, killed after the answer was written."""

    def send_task(self, *args: Any, **options: Any) -> None:
        return None


@pytest.mark.parametrize("cut", ["broker-refuses", "killed-in-between"])
def test_an_answer_whose_task_was_never_sent_is_sent_by_the_watchdog(
    client: Client, script, settings: Settings, tmp_path: Path, cut: str
) -> None:
    marker = tmp_path / "ran"
    prompt = script([[command(MACHINE, f"echo once >> {marker}", timeout_ms=LONG_MS)], reply("ok")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    if cut == "broker-refuses":  # its Redis is the fleet's, its broker refuses
        cut_off = Client(settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"}))
    else:
        cut_off = Client(settings, celery_app=Killed())  # type: ignore[arg-type]
    with cut_off:
        answered = cut_off.approve(run.run_id, call_id, by="ann")  # the answer stands
    assert answered.tool_call_id == call_id
    status, events = ended(run)
    assert status == "done"
    (end,) = of(events, "TOOL_END", call_id)
    assert end.data["status"] == "ok", end.data
    assert marker.read_text() == "once\n"
    (resolved,) = of(events, "APPROVAL_RESOLVED", call_id)
    assert (resolved.data["verdict"], resolved.data["by"]) == ("approved", "ann")
    assert approval_entry(client, run.run_id, call_id) is None  # taken: no more re-sends


def test_an_answer_taken_by_a_process_that_is_gone_is_answered_lost_at_once(
    client: Client, script, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    prompt = script([[command(MACHINE, f"echo twice >> {marker}", timeout_ms=LONG_MS)], reply("x")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    # As an earlier process of the machine leaves the record when it dies carrying the
    # answer out; the task the person's answer sends is then the broker's redelivery.
    gone = f"{MACHINE}:1:{'0' * 12}"
    client.redis.hset(client.keys.approval(run.run_id, call_id, MACHINE), "taken", gone)
    run.approve(call_id, by="ann")
    status, events = ended(run)
    assert status == "done"
    (end,) = of(events, "TOOL_END", call_id)
    assert (end.data["status"], end.data["output"]) == (
        "lost",
        f"started on {MACHINE}; outcome unknown; machine lost",
    )
    assert not marker.exists()  # never run twice


def test_a_copy_of_the_answer_while_this_process_carries_it_out_changes_nothing(
    client: Client, script, tmp_path: Path
) -> None:
    from cmdop_worker.messages import send_answer

    marker, going = tmp_path / "ran", tmp_path / "going"
    text = f"touch {going}; sleep 1; echo once >> {marker}"
    prompt = script([[command(MACHINE, text, timeout_ms=LONG_MS)], reply("ok")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    run.approve(call_id, by="ann")
    give_up = time.monotonic() + 30
    while not going.exists():
        assert time.monotonic() < give_up, "the approved call never started"
        time.sleep(0.02)
    parked = loaded(client, run.run_id, call_id)
    assert parked is not None and parked.answer is not None and parked.taken
    send_answer(client.celery, parked.call, parked.answer)  # a copy, while it runs
    status, events = ended(run)
    assert status == "done"
    (end,) = of(events, "TOOL_END", call_id)
    assert end.data["status"] == "ok", end.data
    assert marker.read_text() == "once\n"


@pytest.mark.parametrize("skew_ms", [DAY_MS, -DAY_MS], ids=["ahead", "behind"])
def test_a_client_whose_clock_is_off_answers_a_waiting_call_and_it_gets_its_time(
    client: Client, script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skew_ms: int
) -> None:
    marker = tmp_path / "ran"
    text = f"sleep 0.2; echo ran >> {marker}"
    prompt = script([[command(MACHINE, text, timeout_ms=LONG_MS)], reply("ok")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    monkeypatch.setattr("cmdop_worker.surfaces.answer.now_ms", lambda: now_ms() + skew_ms)
    run.approve(call_id, by="ann")  # ahead: not refused as expired
    status, events = ended(run)
    assert status == "done"
    (end,) = of(events, "TOOL_END", call_id)
    assert end.data["status"] == "ok", end.data  # behind: not timed out at once
    assert marker.read_text() == "ran\n"


def test_a_forged_approval_task_runs_nothing(client: Client, script, tmp_path: Path) -> None:
    """Anyone who can reach the broker can send a `cmdop.tool` task that says
    "approved": the machine runs a parked call only on the answer its record holds."""
    marker = tmp_path / "forged-ran"
    prompt = script([[command(MACHINE, f"touch {marker}", timeout_ms=LONG_MS)], reply("ok")])
    run = client.submit(prompt=prompt)
    (request,) = asked(run)
    call_id = request.data["tool_call_id"]
    record = loaded(client, run.run_id, call_id)
    assert record is not None and record.state == "waiting"
    forged = ApprovalAnswer(verdict="approved", by="mallory", answered_ms=now_ms())
    send_answer(client.celery, record.call, forged)
    queue = machine_queue(MACHINE)
    give_up = time.monotonic() + 30
    while client.redis.llen(queue):  # the machine has taken the forged task in
        assert time.monotonic() < give_up, "the machine never took the forged task"
        time.sleep(0.05)
    run.approve(call_id, approve=False, reason="not asked for", by="ann")
    status, events = ended(run)
    assert status == "done" and not marker.exists()
    (end,) = of(events, "TOOL_END", call_id)
    assert end.data["status"] == "denied" and "not asked for" in end.data["output"]
    assert [e.data["by"] for e in of(events, "APPROVAL_RESOLVED", call_id)] == ["ann"]
