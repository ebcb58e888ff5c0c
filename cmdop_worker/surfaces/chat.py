"""`cmdop-worker chat`: a conversation on a thread, in a terminal, with the live view.

    cmdop-worker chat [--machine M] [--thread T]

Each line typed is a message on the thread: with no run going it starts one, and while
a run is busy it steers that run (`on_busy=steer`, which the fleet turns into a new run
when the thread has just gone idle, so no line is lost to that race). While a call
waits for approval, `y` approves it, `n [reason]` denies it and a JSON object approves
it with that input instead. Ctrl-C ui-cancels the current run and stays; Ctrl-D leaves
(a run still going keeps going).

Two threads: the main one reads lines; a follower shows the current run's events and,
when it ends, follows the thread's next run if one started meanwhile (a queued request,
or messages that came too late to steer). Thin: everything goes through the client.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from typing import Any

from rich.console import Console
from rich.markup import escape

from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import RUN_ID_PATTERN, Event
from cmdop_worker.surfaces.follow import EXIT_OK, EXIT_USAGE
from cmdop_worker.surfaces.render import LiveView

# How long the follower waits for a queued run of the thread to start after a run ends.
_NEXT_RUN_PATIENCE_S = 10.0


class ChatView(LiveView):
    """The live view without the spinner block (it would fight the line being typed),
    saying how to answer an approval inline."""

    def _refresh_live(self) -> None:
        pass

    def _on_approval_request(self, event: Event) -> None:
        d = event.data
        self._line(
            f"[magenta]? {escape(d['tool'])} on {escape(str(d.get('machine')))} needs approval "
            f"({escape(d['reason'])}): {escape(json.dumps(d.get('input')))}[/]\n"
            "[magenta]  y approves, n [reason] denies, a JSON object approves it with that "
            f"input; denied if unanswered within {d.get('timeout_s', 0):g} s[/]"
        )


class ChatSession:
    def __init__(
        self, client: Any, console: Console, *, thread_id: str, machine: str | None
    ) -> None:
        self.client, self.console = client, console
        self.thread_id, self.machine = thread_id, machine
        self.lock = threading.Lock()
        self.current: str | None = None  # the run being followed
        self.followed: set[str] = set()
        self.pending: list[str] = []  # runs to show next, in order
        self.waiting: dict[str, dict[str, Any]] = {}  # approval requests, by call id
        self.follower: threading.Thread | None = None

    # -- lines typed --------------------------------------------------------------------

    def handle(self, line: str) -> None:
        line = line.strip()
        if not line:
            return
        if self.waiting and self._answer(line):
            return
        request: dict[str, Any] = {"prompt": line, "thread_id": self.thread_id, "on_busy": "steer"}
        if self.machine:
            request["machine"] = self.machine
        try:
            run = self.client.submit(request)
        except InvalidRequest as exc:
            self.console.print(f"[red]{escape(str(exc))}[/]")
            return
        if not run.wait_started(5):
            self.console.print("[yellow]no coordinator has taken the message yet; it waits[/]")
        if run.steered_from is None:
            self._follow(run.run_id)

    def _answer(self, line: str) -> bool:
        """A line that answers the oldest waiting approval; False for any other line."""
        word, _, rest = line.partition(" ")
        edited = _json_object(line)
        if word.lower() not in ("y", "yes", "n", "no") and edited is None:
            return False
        with self.lock:
            tool_call_id, asked = next(iter(self.waiting.items()))
        options: dict[str, Any] = {"approve": word.lower() in ("y", "yes") or edited is not None}
        if edited is not None:
            options["input"] = edited
        elif not options["approve"] and rest.strip():
            options["reason"] = rest.strip()
        try:
            self.client.approve(asked["run_id"], tool_call_id, **options)
        except Exception as exc:  # not waiting any more: say why, keep chatting
            self.console.print(f"[yellow]{escape(str(exc))}[/]")
        with self.lock:
            self.waiting.pop(tool_call_id, None)
        return True

    def interrupt(self) -> None:
        """Ctrl-C: a ui cancel of the current run, if one is going."""
        run_id = self.current
        if run_id is None:
            self.console.print("[dim](no run is going; Ctrl-D leaves)[/]")
            return
        self.client.cancel(run_id, ui=True, reason="Ctrl-C")
        self.console.print("[yellow]cancelling the run…[/]")

    # -- the follower -------------------------------------------------------------------

    def _follow(self, run_id: str) -> None:
        with self.lock:
            if run_id in self.followed:
                return
            self.followed.add(run_id)
            self.pending.append(run_id)
            if self.follower is None:
                self.follower = threading.Thread(target=self._show, daemon=True)
                self.follower.start()

    def _show(self) -> None:
        while (run_id := self._take()) is not None:
            self.current = run_id
            view = ChatView(self.console)
            for event in self.client.run(run_id).events():
                self._note(event)
                view.show(event)
            view.close()
            self.current = None
            following = self._next_run(run_id)
            with self.lock:
                if following is not None and following not in self.followed:
                    self.followed.add(following)
                    self.pending.append(following)

    def _take(self) -> str | None:
        """The next run to show; None (and the follower ends) when there is none."""
        with self.lock:
            if self.pending:
                return self.pending.pop(0)
            self.follower = None
            return None

    def _note(self, event: Event) -> None:
        with self.lock:
            if event.type == "APPROVAL_REQUEST":
                self.waiting[event.data["tool_call_id"]] = {"run_id": event.run_id}
            elif event.type in ("APPROVAL_RESOLVED", "TOOL_END"):
                self.waiting.pop(event.data.get("tool_call_id", ""), None)

    def _next_run(self, ended: str) -> str | None:
        """A run of the thread newer than `ended` that nobody followed yet: one that
        started meanwhile, or the one waiting first in the thread's queue (a follow-up
        answering messages that came too late to steer `ended`), once it starts."""
        give_up = time.monotonic() + _NEXT_RUN_PATIENCE_S
        while True:
            info = self.client.thread(self.thread_id)
            runs = info.runs if info is not None else []
            later = runs[runs.index(ended) + 1 :] if ended in runs else []
            fresh = [run_id for run_id in later if run_id not in self.followed]
            if fresh or info is None or not info.queued or time.monotonic() > give_up:
                return fresh[0] if fresh else None
            time.sleep(0.05)


def _json_object(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def run_chat(client: Any, *, thread_id: str | None, machine: str | None) -> int:
    console = Console(highlight=False)
    if thread_id is not None and not re.match(RUN_ID_PATTERN, thread_id):
        console.print(f"cmdop-worker: '{escape(thread_id)}' is not a valid thread id")
        return EXIT_USAGE
    thread_id = thread_id or f"chat-{uuid.uuid4().hex[:12]}"
    console.print(
        f"[dim]thread {escape(thread_id)} (resume with --thread {escape(thread_id)}); "
        "Ctrl-C stops the run, Ctrl-D leaves[/]"
    )
    session = ChatSession(client, console, thread_id=thread_id, machine=machine)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        except KeyboardInterrupt:
            session.interrupt()
            continue
        session.handle(line)
    if session.current is not None:
        console.print(f"[dim]left; run {session.current} goes on[/]")
    return EXIT_OK
