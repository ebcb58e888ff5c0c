"""`cmdop-worker chat`: a conversation on a thread, in a terminal, with the live view.

    cmdop-worker chat [--machine M] [--thread T]

Each line typed is a message on the thread: with no run going it starts one, and while
a run is busy it steers that run (`on_busy=steer`, which the fleet turns into a new run
when the thread has just gone idle, so no line is lost to that race). A call waiting
for approval is answered only by a command (`chat_answers`): `/approve`, `/deny
[reason]`, `/edit {json}`; any other line, "yes" included, is a message to the run.
Ctrl-C ui-cancels the current run and stays; Ctrl-D leaves (a run still going keeps
going). What the fleet sends is shown through `screen`, as in the live view.

Two threads: the main one reads lines; a follower shows the current run's events and,
when it ends, follows the thread's next run if one started meanwhile (a queued request,
or messages that came too late to steer). Thin: everything goes through the client.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import uuid
from typing import Any

from rich.console import Console

from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import RUN_ID_PATTERN, Event
from cmdop_worker.surfaces.chat_answers import HINT, Answer, Refused, chat_answer
from cmdop_worker.surfaces.follow import EXIT_OK, EXIT_USAGE
from cmdop_worker.surfaces.render import LiveView
from cmdop_worker.surfaces.screen import safe_markup, terminal_safe

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
            f"[magenta]? {safe_markup(d['tool'])} on {safe_markup(d.get('machine'))} needs "
            f"approval ({safe_markup(d['reason'])}): "
            f"{safe_markup(json.dumps(d.get('input'), ensure_ascii=False))}[/]\n"
            f"[magenta]  {safe_markup(HINT)} (call {safe_markup(d['tool_call_id'])}); "
            f"denied if unanswered within {d.get('timeout_s', 0):g} s[/]"
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
        with self.lock:
            waiting = list(self.waiting)
        answer = chat_answer(line, waiting)
        if isinstance(answer, Refused):
            self.console.print(f"[yellow]{safe_markup(answer.message)}[/]")
        elif answer is not None:
            self._answer(answer)
        else:
            self._say(line, waiting)

    def _say(self, line: str, waiting: list[str]) -> None:
        """A message on the thread: a new run, or steering the busy one."""
        request: dict[str, Any] = {"prompt": line, "thread_id": self.thread_id, "on_busy": "steer"}
        if self.machine:
            request["machine"] = self.machine
        try:
            run = self.client.submit(request)
        except InvalidRequest as exc:
            self.console.print(f"[red]{safe_markup(exc)}[/]")
            return
        if waiting:
            note = safe_markup(f"(sent as a message; a call still waits: {HINT})")
            self.console.print(f"[dim]{note}[/]")
        if not run.wait_started(5):
            self.console.print("[yellow]no coordinator has taken the message yet; it waits[/]")
        if run.steered_from is None:
            self._follow(run.run_id)

    def _answer(self, answer: Answer) -> None:
        with self.lock:
            asked = self.waiting.get(answer.tool_call_id)
        if asked is None:  # answered meanwhile
            return
        try:
            self.client.approve(
                asked["run_id"],
                answer.tool_call_id,
                approve=answer.approve,
                input=answer.input,
                reason=answer.reason,
                shown=asked["shown"],
            )
        except Exception as exc:  # not waiting any more: say why, keep chatting
            self.console.print(f"[yellow]{safe_markup(exc)}[/]")
        with self.lock:
            self.waiting.pop(answer.tool_call_id, None)

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
                # what the person is shown: an answer is to that, or to nothing
                self.waiting[event.data["tool_call_id"]] = {
                    "run_id": event.run_id,
                    "shown": event.data,
                }
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


def run_chat(client: Any, *, thread_id: str | None, machine: str | None) -> int:
    console = Console(highlight=False)
    if thread_id is not None and not re.match(RUN_ID_PATTERN, thread_id):
        print(
            f"cmdop-worker: '{terminal_safe(thread_id)}' is not a valid thread id", file=sys.stderr
        )
        return EXIT_USAGE
    thread_id = thread_id or f"chat-{uuid.uuid4().hex[:12]}"
    console.print(
        f"[dim]thread {safe_markup(thread_id)} (resume with --thread {safe_markup(thread_id)}); "
        "/approve, /deny, /edit answer a call waiting for approval; "
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
        console.print(f"[dim]left; run {safe_markup(session.current)} goes on[/]")
    return EXIT_OK
