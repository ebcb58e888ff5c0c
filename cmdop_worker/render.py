"""Showing a run's events to a person (rich) or a script (`--json`, one event a line).

`LiveView` prints tokens as they arrive, a line per tool start and end with its
machine and time, and a closing summary; while tools run, a status line with a spinner
shows each running tool and its elapsed time. With stdout not a terminal, output is
plain text without colour or spinner. Pure presentation: it receives events and
decides nothing about the run.
"""

from __future__ import annotations

import json
import time
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape
from rich.status import Status

from cmdop_worker.models import Event


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
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


class JsonView:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def show(self, event: Event) -> None:
        self.out.write(event.model_dump_json() + "\n")
        self.out.flush()

    def close(self) -> None:
        pass


class LiveView:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.running: dict[str, tuple[str, str | None, float]] = {}
        self.in_text = False
        self.status: Status | None = None
        self.started = time.monotonic()
        self.turns = 0

    def show(self, event: Event) -> None:
        handler = getattr(self, f"_on_{event.type.lower()}", None)
        if handler is not None:
            handler(event)
        self.turns = max(self.turns, event.turn)
        self._refresh_status()

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    def _line(self, markup: str) -> None:
        if self.in_text:
            self.console.print()
            self.in_text = False
        self.console.print(markup, highlight=False)

    def _on_token(self, event: Event) -> None:
        self.console.print(escape(event.data["text"]), end="", highlight=False, markup=True)
        self.in_text = True

    def _on_thinking(self, event: Event) -> None:
        pass  # thinking is shown only with --json; people want the answer

    def _on_tool_start(self, event: Event) -> None:
        d = event.data
        self.running[d["tool_call_id"]] = (d["tool"], d.get("machine"), time.monotonic())
        where = f" on [bold]{escape(str(d.get('machine')))}[/]" if d.get("machine") else ""
        self._line(
            f"[cyan]▶ {escape(d['tool'])}[/]{where} "
            f"[dim]{escape(summarize_input(d.get('input')))}[/]"
        )

    def _on_tool_end(self, event: Event) -> None:
        d = event.data
        self.running.pop(d["tool_call_id"], None)
        mark = "[red]✗[/]" if d.get("is_error") else "[green]✓[/]"
        where = f" on {escape(str(d.get('machine')))}" if d.get("machine") else ""
        took = f"{d.get('duration_ms', 0) / 1000:.2f}s"
        self._line(
            f"{mark} {escape(d['tool'])}{where} [dim]({took})[/] "
            f"{escape(first_line(d.get('output', '')))}"
        )

    def _on_retry(self, event: Event) -> None:
        d = event.data
        self._line(
            f"[yellow]↻ model retry {d['attempt']} in {d['delay_ms']} ms: {escape(d['cause'])}[/]"
        )

    def _on_approval_request(self, event: Event) -> None:
        d = event.data
        self._line(
            f"[magenta]? {escape(d['tool'])} on {escape(str(d.get('machine')))} needs approval: "
            f"{escape(d['reason'])} — `cmdop-worker approve {event.run_id} {d['tool_call_id']}`[/]"
        )

    def _on_done(self, event: Event) -> None:
        d = event.data
        if not self.in_text and d.get("text"):
            self.console.print(escape(d["text"]), highlight=False)
        self._summary("done", d.get("stop_reason", ""), d.get("usage", {}), d.get("turns", 0))

    def _on_error(self, event: Event) -> None:
        d = event.data
        self._line(f"[bold red]error[/] {escape(d['kind'])}: {escape(d['message'])}")

    def _on_cancelled(self, event: Event) -> None:
        d = event.data
        self._line(f"[bold yellow]cancelled[/] ({d['channel']}: {escape(d['reason'])})")
        self._summary("cancelled", "cancelled", d.get("usage", {}), event.turn)

    def _summary(self, what: str, stop: str, usage: dict[str, int], turns: int) -> None:
        took = time.monotonic() - self.started
        tokens_in = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        self._line(
            f"[dim]── {what}: {turns} turns · {tokens_in} in / "
            f"{usage.get('output_tokens', 0)} out tokens"
            f" · {usage.get('cache_read_input_tokens', 0)} from cache · {took:.1f}s · {stop}[/]"
        )

    def _refresh_status(self) -> None:
        if not self.console.is_terminal:
            return
        if not self.running:
            self.close()
            return
        now = time.monotonic()
        label = ", ".join(
            f"{tool}@{machine or 'coordinator'} {now - t0:.1f}s"
            for tool, machine, t0 in self.running.values()
        )
        if self.status is None:
            self.status = self.console.status(label)
            self.status.start()
        else:
            self.status.update(label)
