"""Structured logs: every line a worker writes names the run, turn, tool and machine.

Each task binds its context first thing (`bind(run_id=..., turn=..., tool=...,
machine=...)`, in `tasks`); `lifecycle` clears it before and after every task, so
Celery's own lines about the task (succeeded, failed, traceback) carry it too.
`log_context` binds for a block. `ContextFilter` copies the context onto every record,
`-` where a field is unknown; a machine worker's own name stands in for `machine`
outside tasks. `install` puts the filter and a formatter on the handlers Celery set
up (called from `lifecycle` on Celery's logging signals). `log_thread_crashes` makes a
thread that dies of an exception log it as one record: by default its traceback goes
to stderr, which Celery turns into a record per write — one per character of a `^^^`
line. Lines are plain text:

    2026-11-30 19:40:01,123 INFO run=5f3a… turn=2 tool=execute_command machine=alpha \
cmdop_worker.machine.worker: ...

or, with `CMDOP_LOG_JSON=true`, one JSON object per line with the same fields.

A line may carry what a tool or the model chose (a host egress refused, a tool's or
machine's name, a reason, a path), and logs are read on terminals: every plain record
passes through `textsafe.terminal_safe` whole (message, arguments, context fields and
traceback), and each of its lines after the first is indented, so no value can start
a line that reads as a record of its own. A JSON line is passed through
`textsafe.json_safe`: JSON escapes C0 itself, and DEL, C1, bidi and invisible format
characters become `\\uXXXX` escapes too; the line still parses to the same values.
Contextvars, so concurrent tasks on a threads pool never see each other's context.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import threading
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cmdop_worker.core.textsafe import json_safe, terminal_safe

FIELDS = ("run_id", "turn", "tool", "machine")
PLAIN_FORMAT = (
    "%(asctime)s %(levelname)s run=%(run_id)s turn=%(turn)s tool=%(tool)s "
    "machine=%(machine)s %(name)s: %(message)s"
)
CONTINUED = "    "  # before each line of a record after its first
_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "cmdop_log_context", default=MappingProxyType({})
)


class LogSettings(BaseSettings):
    """Read apart from `Settings`: Celery sets logging up before a worker's runtime."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore")

    json_lines: bool = Field(default=False, validation_alias="CMDOP_LOG_JSON")


def bind(**fields: Any) -> None:
    """Add fields (None values skipped) to this thread's context until `clear()`."""
    _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})


def clear() -> None:
    _context.set(MappingProxyType({}))


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Every log line written inside names these fields (None values are skipped)."""
    known = {k: v for k, v in fields.items() if v is not None}
    token = _context.set({**_context.get(), **known})
    try:
        yield
    finally:
        _context.reset(token)


def current_context() -> dict[str, Any]:
    return dict(_context.get())


class ContextFilter(logging.Filter):
    def __init__(self, defaults: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.defaults = {k: v for k, v in (defaults or {}).items() if v is not None}

    def filter(self, record: logging.LogRecord) -> bool:
        context = {**self.defaults, **_context.get()}
        for name in FIELDS:
            if not hasattr(record, name):
                setattr(record, name, context.get(name, "-"))
        return True


class PlainFormatter(logging.Formatter):
    """`PLAIN_FORMAT`, made safe for a terminal (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(PLAIN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return terminal_safe(super().format(record)).replace("\n", "\n" + CONTINUED)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            **{name: getattr(record, name, "-") for name in FIELDS},
            "message": record.getMessage(),
        }
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json_safe(json.dumps(body, default=str, ensure_ascii=False))


def install(logger: logging.Logger, *, json_lines: bool, machine: str | None = None) -> None:
    """Give each of `logger`'s handlers the context filter and the chosen format."""
    formatter = JsonFormatter() if json_lines else PlainFormatter()
    for handler in logger.handlers:
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter({"machine": machine}))
        handler.setFormatter(formatter)


def log_thread_crashes() -> None:
    """A thread that dies of an exception logs it as one record (see the docstring)."""
    threading.excepthook = _log_thread_crash


def _log_thread_crash(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as the default hook: a thread may exit this way
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger(__name__).error("thread %s died", name, exc_info=args.exc_value)
