"""Showing a run's events to a person (rich) or a script (`--json`, one event a line).

`LiveView` prints the run id, tokens as they arrive, a line per tool start and end with
its machine and time, and a closing summary (turns, tokens, cache hits, and the run's
time from its start to its terminal event, so a replay says what the run said); while tools
run, a live block below shows a spinner per running tool with its machine and a
ticking elapsed time. With stdout not a terminal the output is plain text: no colour,
no spinner, no wrapping. Pure presentation: it receives events and decides nothing
about the run. Everything an event carries is shown through `screen` (no control
character from the model, a tool or Redis reaches the terminal) and into markup
escaped; `JsonView` writes the events byte for byte.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner
from rich.text import Text

from cmdop_worker.core.figures import preview, took, usage_line
from cmdop_worker.core.textsafe import one_line
from cmdop_worker.models import Event
from cmdop_worker.surfaces.screen import safe_markup, terminal_safe


def summarize_input(data: Any, limit: int = 80) -> str:
    if isinstance(data, dict):
        parts = [
            f"{k}={v!r}" if not isinstance(v, str) else f"{k}={v}"
            for k, v in data.items()
            if k != "machine"
        ]
        text = " ".join(parts)
    else:
        text = json.dumps(data)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class JsonView:
    """Events on `out`, one JSON a line; anything else (the run id) on `err`."""

    def __init__(self, out: TextIO, err: TextIO | None = None) -> None:
        self.out = out
        self.err = err or sys.stderr

    def begin(self, run_id: str) -> None:
        print(f"run {run_id}", file=self.err, flush=True)

    def run_started(self, started_ms: int) -> None:
        pass

    def show(self, event: Event) -> None:
        self.out.write(event.model_dump_json() + "\n")
        self.out.flush()

    def close(self) -> None:
        pass


class RunningTools:
    """The live block: one spinner per running tool, re-rendered (elapsed time
    included) on every refresh of the display."""

    def __init__(self) -> None:
        self.tools: dict[str, tuple[Spinner, str, float]] = {}

    def add(self, tool_call_id: str, tool: str, machine: str | None) -> None:
        label = f"{safe_markup(tool)} on [bold]{safe_markup(machine or 'coordinator')}[/]"
        self.tools[tool_call_id] = (Spinner("dots", style="cyan"), label, time.monotonic())

    def remove(self, tool_call_id: str) -> None:
        self.tools.pop(tool_call_id, None)

    def __rich__(self) -> RenderableType:
        now = time.monotonic()
        for spinner, label, started in self.tools.values():
            spinner.update(text=Text.from_markup(f"{label} [dim]{now - started:.1f}s[/]"))
        return Group(*(spinner for spinner, _, _ in self.tools.values()))


class LiveView:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.running = RunningTools()
        self.in_text = False
        self.live: Live | None = None
        self.announced = False
        self.started_ms: int | None = None
        self.tool_started_ms: dict[str, int] = {}  # by call id: its TOOL_START's time

    def begin(self, run_id: str) -> None:
        """The first line: the run's id, shown once, as soon as it is known."""
        if not self.announced:
            self.announced = True
            self._line(f"[dim]run {safe_markup(run_id)}[/]")

    def run_started(self, started_ms: int) -> None:
        """When the run started (its record's clock); the summary's time counts from it."""
        self.started_ms = started_ms

    def show(self, event: Event) -> None:
        self.begin(event.run_id)
        if self.started_ms is None:
            self.started_ms = event.ts_ms
        handler = getattr(self, f"_on_{event.type.lower()}", None)
        if handler is not None:
            handler(event)
        self._refresh_live()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def _line(self, markup: str) -> None:
        """One line of markup; its values already went through `safe_markup`, and the
        whole line goes through `terminal_safe` again so that one value forgotten
        cannot reach the terminal raw (the templates themselves hold no controls)."""
        if self.in_text:
            self.console.print()
            self.in_text = False
        self.console.print(terminal_safe(markup), highlight=False, soft_wrap=True)

    def _text(self, text: str, end: str = "\n") -> None:
        """Text from the model, shown as it is: no markup, no control characters."""
        self.console.print(
            Text(terminal_safe(text)), end=end, markup=False, highlight=False, soft_wrap=True
        )

    def _on_token(self, event: Event) -> None:
        self._text(str(event.data["text"]), end="")
        self.in_text = True

    def _on_thinking(self, event: Event) -> None:
        pass  # thinking is shown only with --json; people want the answer

    def _on_tool_start(self, event: Event) -> None:
        d = event.data
        self.running.add(d["tool_call_id"], d["tool"], d.get("machine"))
        self.tool_started_ms[d["tool_call_id"]] = event.ts_ms
        where = f" on [bold]{safe_markup(d.get('machine'))}[/]" if d.get("machine") else ""
        self._line(
            f"[cyan]▶ {safe_markup(d['tool'])}[/]{where} "
            f"[dim]{safe_markup(summarize_input(d.get('input')))}[/]"
        )

    def _on_tool_end(self, event: Event) -> None:
        d = event.data
        self.running.remove(d["tool_call_id"])
        mark = "[red]✗[/]" if d.get("is_error") else "[green]✓[/]"
        where = f" on {safe_markup(d.get('machine'))}" if d.get("machine") else ""
        began = self.tool_started_ms.pop(d["tool_call_id"], None)
        elapsed = None if began is None else event.ts_ms - began
        ran = took(int(d.get("duration_ms", 0)), int(d.get("waited_ms", 0)), elapsed_ms=elapsed)
        # Made safe before its lines are picked: a bare CR shows on its line.
        head = preview(terminal_safe(str(d.get("output", "")))) or [""]
        self._line(
            f"{mark} {safe_markup(d['tool'])}{where} [dim]({safe_markup(ran)})[/] "
            f"{safe_markup(head[0])}"
        )
        for line in head[1:]:
            self._line(f"  [dim]{safe_markup(line)}[/]")

    def _on_retry(self, event: Event) -> None:
        d = event.data
        self._line(
            f"[yellow]↻ model retry {safe_markup(d['attempt'])} in {safe_markup(d['delay_ms'])} "
            f"ms: {safe_markup(d['cause'])}[/]"
        )

    def _on_approval_request(self, event: Event) -> None:
        d = event.data
        answer = f"cmdop-worker approve {event.run_id} {d['tool_call_id']}"
        resolved = d.get("resolved_input")
        if isinstance(resolved, dict) and "path" in resolved:
            self._line(f"[magenta]  the path resolves to {safe_markup(resolved['path'])}[/]")
        self._line(
            f"[magenta]? {safe_markup(d['tool'])} on {safe_markup(d.get('machine'))} needs "
            f"approval: {safe_markup(d['reason'])}[/]\n"
            f"[magenta]  `{safe_markup(answer)}` to allow it, add --deny to refuse; "
            f"denied if unanswered within {d.get('timeout_s', 0):g} s. "
            "Standing rules: the policy file in CMDOP_POLICY_FILE "
            "(see config/policy.example.toml)[/]"
        )

    def _on_approval_resolved(self, event: Event) -> None:
        d = event.data
        edited = f" with input {summarize_input(d['input'])}" if d.get("input") else ""
        why = f": {safe_markup(d['reason'])}" if d.get("reason") else ""
        self._line(
            f"[magenta]  {safe_markup(d['verdict'])} by {escape(one_line(str(d['by'])))}"
            f"{safe_markup(edited)}{why}[/]"
        )

    def _on_steered(self, event: Event) -> None:
        self._line(f"[dim]↪ steered: {safe_markup(event.data['text'])}[/]")

    def _on_done(self, event: Event) -> None:
        d = event.data
        if not self.in_text and d.get("text"):
            self._text(str(d["text"]))
        self._summary(event, "done", d.get("stop_reason", ""), d.get("turns", 0))

    def _on_error(self, event: Event) -> None:
        d = event.data
        self._line(f"[bold red]error[/] {safe_markup(d['kind'])}: {safe_markup(d['message'])}")

    def _on_cancelled(self, event: Event) -> None:
        d = event.data
        self._line(
            f"[bold yellow]cancelled[/] ({safe_markup(d['channel'])}: {safe_markup(d['reason'])})"
        )
        self._summary(event, "cancelled", "cancelled", event.turn)

    def _summary(self, event: Event, what: str, stop: str, turns: int) -> None:
        usage = event.data.get("usage", {})
        seconds = (event.ts_ms - (self.started_ms or event.ts_ms)) / 1000
        self._line(
            f"[dim]── {what}: {plural(turns, 'turn')} · {safe_markup(usage_line(usage))}"
            f" · {seconds:.1f}s · {safe_markup(stop)}[/]"
        )

    def _refresh_live(self) -> None:
        if not self.console.is_terminal:
            return
        if not self.running.tools:
            self.close()
        elif self.live is None:
            self.live = Live(
                self.running, console=self.console, refresh_per_second=10, transient=True
            )
            self.live.start()
