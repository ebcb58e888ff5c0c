"""Every failure cmdop-worker raises, under one base.

    CmdopError
    ├── InvalidRequest        a run request that does not validate (names the field)
    ├── DuplicateRun          a run id that is already taken
    ├── ThreadBusy            a thread has a running run and the request said on_busy=reject
    ├── RunNotFound           no run with that id (client)
    ├── ApprovalNotPending    no approval request of that call is waiting for an answer (client)
    ├── SelectorError         a label selector that does not parse (`core.selectors`; a ValueError)
    ├── WaitTimeout           a client stopped waiting before the run ended
    ├── RunFailed             a run ended with ERROR (client; carries the RunResult)
    ├── RunCancelled          a run ended CANCELLED (client; carries the RunResult)
    ├── ModelError            the model call failed for good: `kind` says why
    ├── LeaseLost             internal: a turn's executor lost its lease; its write was refused
    └── StopNow               internal: a ui cancel interrupted work in progress

Tool failures are not exceptions: they are `ToolOutcome`s with an error status, and
the model reads them as error tool results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cmdop_worker.models import RunResult


class CmdopError(Exception):
    """Base of every error raised by cmdop-worker."""


class InvalidRequest(CmdopError, ValueError):
    pass


class DuplicateRun(InvalidRequest):
    pass


class ThreadBusy(InvalidRequest):
    pass


class RunNotFound(CmdopError, LookupError):
    pass


class WaitTimeout(CmdopError, TimeoutError):
    pass


class ApprovalNotPending(CmdopError, LookupError):
    """An answer to a tool call nobody is waiting on; `why` says which case:
    "no_request" (the run never parked that call), "answered" (a person answered it
    already), "expired" (its wait is over), "cancelled" (a cancel answered it while it
    waited), "ended" (it has an outcome another way, e.g. its machine was lost)."""

    def __init__(self, why: str, message: str) -> None:
        super().__init__(message)
        self.why = why


class _RunEnded(CmdopError):
    def __init__(self, result: RunResult) -> None:
        detail = result.error.message if result.error else result.stop_reason
        super().__init__(f"run {result.run_id} ended {result.status}: {detail}")
        self.result = result


class RunFailed(_RunEnded):
    pass


class RunCancelled(_RunEnded):
    pass


class ModelError(CmdopError):
    def __init__(self, kind: str, message: str, *, attempts: int = 1) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.attempts = attempts


class LeaseLost(CmdopError):
    """A turn's executor wrote its run's state after losing the turn (its lease lapsed,
    a successor may hold it): nothing was written, and the executor must stop."""


class StopNow(CmdopError):
    """A ui cancel (or the run's deadline) interrupted work in progress."""

    def __init__(self, partial_text: str = "") -> None:
        super().__init__("stopped by a cancel")
        self.partial_text = partial_text  # what clients had already been shown
