"""What the gateway's write routes do, over the client: start, cancel, approve, view.

Each function takes the synchronous `Client`, runs in a worker thread of the gateway
and returns `(status, body)` — the HTTP answer — turning the client's errors into
the API's: `InvalidRequest` 422, `ThreadBusy` and `DuplicateRun` 409, `RunNotFound`
404, `ApprovalNotPending` 404 for a call never parked and 409 for one no longer
waiting (`why` says which). Starting a run waits, up to `wait_s`, for the fleet's
verdict in `cmdop.run`: a thread that is busy refuses it, or it steers the running
run — whose id is then the answer — or a coordinator takes it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from cmdop_worker.errors import (
    ApprovalNotPending,
    DuplicateRun,
    InvalidRequest,
    RunNotFound,
    ThreadBusy,
)
from cmdop_worker.surfaces.client import Client, Run
from cmdop_worker.surfaces.gateway_schema import ApprovalBody, CancelBody, RunCreated, RunView

Answer = tuple[int, dict[str, Any]]
POLL_S = 0.01


def error(status: int, code: str, message: str, **extra: Any) -> Answer:
    return status, {"error": code, "message": message, **extra}


class Submitted:
    """Run ids this gateway started lately: a cancel of one still queued is kept for
    its start (`Client.cancel(submitted=True)`), not refused as an unknown run."""

    def __init__(self, size: int = 10_000) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def add(self, run_id: str) -> None:
        with self._lock:
            self._ids[run_id] = None
            while len(self._ids) > self._size:
                self._ids.popitem(last=False)

    def __contains__(self, run_id: object) -> bool:
        with self._lock:
            return run_id in self._ids


def start_run(client: Client, payload: Any, submitted: Submitted, wait_s: float) -> Answer:
    if not isinstance(payload, dict):
        return error(422, "invalid_request", "request: expected a JSON object")
    try:
        run = client.submit(payload)
        submitted.add(run.run_id)
        created = verdict(client, run, wait_s)
    except ThreadBusy as exc:
        return error(409, "thread_busy", str(exc))
    except DuplicateRun as exc:
        return error(409, "duplicate_run", str(exc))
    except InvalidRequest as exc:
        return error(422, "invalid_request", str(exc))
    if run.warnings:  # such as: its machine is known but offline now
        created = created.model_copy(update={"warnings": list(run.warnings)})
    status = 200 if created.status == "steered" else 201
    return status, created.model_dump(exclude_none=True)


def verdict(client: Client, run: Run[Any], wait_s: float) -> RunCreated:
    """What became of a submitted run within `wait_s`: refused (raises), steered
    another, taken by a coordinator, or waiting (for its thread or a coordinator)."""
    own_id = run.run_id
    keys = client.keys
    start = client.celery.AsyncResult(f"{own_id}.start")
    give_up = time.monotonic() + wait_s
    while True:
        # Read first: a verdict seen here is then seen by `raise_if_refused` too.
        settled = start.state == "SUCCESS" or time.monotonic() >= give_up
        run.raise_if_refused()
        if run.steered_from is not None:
            return RunCreated(run_id=run.run_id, status="steered", steered_from=own_id)
        if client.redis.exists(keys.state(own_id), keys.result(own_id)):
            return RunCreated(run_id=own_id, status="running")
        if settled:  # SUCCESS without a record: it waits for its thread; else for a coordinator
            return RunCreated(run_id=own_id, status="queued")
        time.sleep(POLL_S)


def view_run(client: Client, run_id: str) -> Answer:
    state = client.store.load(run_id)
    result = client.result(run_id)
    if state is None and result is None:
        return error(404, "not_found", f"no run {run_id} (unknown, expired, or still queued)")
    last_seq = int(client.redis.get(client.keys.seq(run_id)) or 0)
    view = RunView(
        run_id=run_id,
        status=result.status if result is not None else "running",
        last_seq=last_seq,
        turn=None if state is None else state.turn,
        thread_id=None if state is None else state.request.thread_id,
        result=result,
    )
    return 200, view.model_dump(mode="json", exclude_none=True)


def cancel_run(client: Client, run_id: str, body: CancelBody, submitted: Submitted) -> Answer:
    ui = body.channel == "ui"
    if client.cancel(run_id, ui=ui, reason=body.reason, submitted=run_id in submitted):
        return 202, {"run_id": run_id, "channel": body.channel, "cancelling": True}
    if client.result(run_id) is not None:
        return error(409, "run_ended", f"run {run_id} has already ended; nothing to cancel")
    return error(404, "not_found", f"no run {run_id} (unknown, or expired)")


def approver(caller: str | None, said: str | None) -> str:
    """Who an approval is recorded as given by: the name of the caller's token, with
    the body's `by` beside it when it says someone else (a bot answering for a person);
    with no tokens configured, the body's `by`, else "gateway"."""
    if caller is None:
        return said or "gateway"
    if said is None or said == caller:
        return caller
    return f"{said} (via {caller})"


def approve_call(
    client: Client, run_id: str, tool_call_id: str, body: ApprovalBody, by: str
) -> Answer:
    if body.reason is not None and body.approve:
        return error(
            422, "invalid_request", "reason: goes with approve=false (tells the model why)"
        )
    try:
        asked = client.approve(
            run_id,
            tool_call_id,
            approve=body.approve,
            input=body.input,
            reason=body.reason,
            by=by,
            shown=body.shown,
        )
    except RunNotFound as exc:
        return error(404, "not_found", str(exc))
    except ApprovalNotPending as exc:
        status = 404 if exc.why == "no_request" else 409
        return error(status, "approval_not_pending", str(exc), why=exc.why)
    except InvalidRequest as exc:
        return error(422, "invalid_request", str(exc))
    answered = {
        "run_id": run_id,
        "tool_call_id": tool_call_id,
        "verdict": "approved" if body.approve else "denied",
        "tool": asked.tool,
        "machine": asked.machine,
    }
    return 200, answered
