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
from rich.spinner import Spinner
from rich.text import Text

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


def first_line(text: str, limit: int = 100) -> str:
    """The most telling line of a tool's output: the first one, unless that is only a
    zero exit code or a section marker (`--- stdout ---`), in which case the next."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    telling = [line for line in lines if not line.startswith("--- ")]
    if len(telling) > 1 and telling[0] == "exit_code: 0":
        telling = telling[1:]
    line = telling[0].strip() if telling else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


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
        took = f"{d.get('duration_ms', 0) / 1000:.2f}s"
        # Made safe before its first line is picked: a bare CR shows on that line.
        output = terminal_safe(str(d.get("output", "")))
        self._line(
            f"{mark} {safe_markup(d['tool'])}{where} [dim]({took})[/] "
            f"{safe_markup(first_line(output))}"
        )

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
            f"[magenta]  {safe_markup(d['verdict'])} by {safe_markup(d['by'])}"
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
        usage: dict[str, int] = event.data.get("usage", {})
        took = (event.ts_ms - (self.started_ms or event.ts_ms)) / 1000
        tokens_in = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        self._line(
            f"[dim]── {what}: {plural(turns, 'turn')} · {tokens_in} in / "
            f"{usage.get('output_tokens', 0)} out tokens"
            f" · {usage.get('cache_read_input_tokens', 0)} from cache · {took:.1f}s · {stop}[/]"
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
