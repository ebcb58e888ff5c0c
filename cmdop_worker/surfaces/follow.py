"""Following a run in a terminal: its events shown by a view until it ends.

`follow` is what `cmdop-worker run`, `events` and `demo` share: it reads a run's
events through the client, hands each to a view (`render`), turns the terminal event
into the CLI's exit code, and makes Ctrl-C a ui cancel. With `start_within_s` it gives
up (exit 1) when no coordinator has taken the run by then. The exit codes live here so
the CLI and the demo agree on them.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from cmdop_worker.surfaces.screen import terminal_safe

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CANCELLED = 0, 1, 2, 130
EXIT_CODES = {"DONE": EXIT_OK, "ERROR": EXIT_ERROR, "CANCELLED": EXIT_CANCELLED}


def follow(
    client: Any,
    run_id: str,
    view: Any,
    *,
    cancel_on_interrupt: bool = False,
    start_within_s: float | None = None,
    submitted: bool = False,
) -> int:
    """Show a run's events until it ends; Ctrl-C sends a ui cancel, a second one quits.
    `submitted`: the caller sent the run itself, so a Ctrl-C while it is still queued
    is kept for its start (`Client.cancel`)."""
    from cmdop_worker.errors import InvalidRequest

    interrupted = False
    run = client.run(run_id)

    def on_interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupted
        if interrupted or not cancel_on_interrupt:
            raise KeyboardInterrupt
        interrupted = True
        # Sent from a thread: the interrupted main thread may hold a Redis pool's lock.
        # The run shown now: a request that steered a run follows (and stops) that one.
        threading.Thread(
            target=client.cancel,
            args=(run.run_id,),
            kwargs={"ui": True, "reason": "Ctrl-C", "submitted": submitted},
        ).start()
        print("cancelling the run… (Ctrl-C again to quit now)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    code = EXIT_ERROR
    try:
        code = _show_events(run, view, start_within_s)
    except InvalidRequest as exc:
        refusal = terminal_safe(str(exc))
        print(f"cmdop-worker: the fleet refused the run: {refusal}", file=sys.stderr)
        code = EXIT_USAGE
    finally:
        view.close()
        signal.signal(signal.SIGINT, previous)
    return code


def _show_events(run: Any, view: Any, start_within_s: float | None) -> int:
    if start_within_s is not None and not run.wait_started(start_within_s):
        print(
            f"cmdop-worker: run {run.run_id} did not start within {start_within_s:g} s "
            "(--timeout): no coordinator took it; it stays queued and runs when one starts",
            file=sys.stderr,
        )
        return EXIT_ERROR
    code = EXIT_ERROR
    for event in run.events():
        if event.is_terminal and (started_ms := run.started_ms()) is not None:
            view.run_started(started_ms)
        view.show(event)
        if event.is_terminal:
            code = EXIT_CODES[event.type]
    return code
