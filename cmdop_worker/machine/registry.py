"""The machine side's tool registry: typed tools in, `ToolOutcome` values out.

A tool is a plain function `fn(args: SomeModel, ctx: ToolContext) -> str | ToolReply`
whose first parameter is annotated with a pydantic model; the model gives the JSON
schema the LLM sees and validates the call. `ToolRegistry.run` turns every problem
(unknown tool, broken JSON, bad arguments, an exception in the tool) into an outcome
with a status, never an exception, and caps and cleans the output.

Who calls it: the machine worker (`side.registry.run(...)`), presence (`.specs()`),
the sandboxed tool server (`toolserve`). Users add tools to the process-wide
registry, the one machine workers serve, with the module-level decorator::

    from cmdop_worker.machine.registry import ToolContext, tool

    class DiskArgs(BaseModel):
        mount: str = "/"

    @tool(tags=("system",), description="Free space on a mount")
    def disk_free(args: DiskArgs, ctx: ToolContext) -> str: ...

Where a tool runs is its registration's `sandbox`: True (the default), in the call's
sandbox, through the `jail_runner` the registry was built with (the default registry's
hands it to a sandboxed tool server, `tooljail`) whenever the call has a bwrap jail;
False, in the worker's own process, with the worker's rights, as the operator
explicitly asked (the worker names it in a warning at start and in its presence);
"self", in this process, because the tool confines its own work through `ctx.jail`
(the built-ins, `builtin`, do). `load_tool_modules` imports the operator's modules
(`CMDOP_TOOL_MODULES`) and tells the sandboxed tool servers to import them too.
"""

from __future__ import annotations

import importlib
import inspect
import json
import threading
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from cmdop_worker.core.tools import cap_output
from cmdop_worker.machine.builtin import (
    execute_command,
    glob,
    grep,
    list_dir,
    read_file,
    write_file,
)
from cmdop_worker.machine.toolcall import CappedReply, ToolContext, ToolReply
from cmdop_worker.machine.tooljail import host, run_user_tool
from cmdop_worker.models import ToolOutcome, ToolSpec

__all__ = [
    "ToolContext",
    "ToolRegistry",
    "ToolReply",
    "default_registry",
    "load_tool_modules",
    "register_builtins",
    "tool",
]

F = TypeVar("F", bound=Callable[..., Any])
Sandboxing = bool | Literal["self"]

# Stripped before validation: the coordinator's routing argument, not the tool's.
ROUTING_KEY = "machine"


# Runs a validated call in the call's sandbox: (tool, arguments, ctx) -> reply.
JailRunner = Callable[[str, dict[str, Any], ToolContext], ToolReply]


@dataclass(frozen=True)
class _Entry:
    spec: ToolSpec
    model: type[BaseModel]
    fn: Callable[[Any, ToolContext], Any]
    sandbox: Sandboxing = True


class ToolRegistry:
    """Named tools, their specs, and a `run` that never raises for tool problems."""

    def __init__(self, jail_runner: JailRunner | None = None) -> None:
        self._tools: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._jail_runner = jail_runner

    def tool(
        self,
        *,
        name: str | None = None,
        tags: Sequence[str] = (),
        core: bool = False,
        description: str | None = None,
        model: type[BaseModel] | None = None,
        sandbox: Sandboxing = True,
    ) -> Callable[[F], F]:
        """Register `fn(args, ctx)`; `model` defaults to the annotation of `args`.
        `sandbox=False` runs it in the worker's own process, unconfined."""
        if sandbox not in (True, False, "self"):
            raise ValueError(f"sandbox must be True, False or 'self', not {sandbox!r}")

        def register(fn: F) -> F:
            args_model = model or _args_model(fn)
            spec = ToolSpec(
                name=name or fn.__name__,
                description=description or inspect.getdoc(fn) or (name or fn.__name__),
                input_schema=clean_schema(args_model.model_json_schema()),
                tags=tuple(tags),
                core=core,
                machine_bound=True,
            )
            with self._lock:
                if spec.name in self._tools:
                    raise ValueError(f"tool {spec.name!r} is already registered")
                self._tools[spec.name] = _Entry(spec, args_model, fn, sandbox)
            return fn

        return register

    def specs(self) -> list[ToolSpec]:
        return [entry.spec for entry in self._tools.values()]

    def names(self) -> list[str]:
        return list(self._tools)

    def unsandboxed(self) -> list[str]:
        """The tools registered with `sandbox=False`: they run in this process."""
        return sorted(name for name, entry in self._tools.items() if entry.sandbox is False)

    def jailed(self) -> list[str]:
        """The tools the jail runner runs (registered with `sandbox=True`)."""
        return sorted(name for name, entry in self._tools.items() if entry.sandbox is True)

    def sandboxed(self, tool: str) -> bool:
        """True when `tool` runs in the call's sandbox through the jail runner."""
        entry = self._tools.get(tool)
        return entry is not None and entry.sandbox is True

    def run(self, tool: str, raw_input: dict[str, Any] | str, ctx: ToolContext) -> ToolOutcome:
        """Validate and run one call; the outcome's output is capped and valid text."""
        started = time.monotonic()
        reply = self.reply(tool, raw_input, ctx)
        capped = isinstance(reply, CappedReply)
        return ToolOutcome(
            tool_use_id=ctx.tool_use_id,
            tool=tool,
            machine=ctx.machine,
            status=reply.status,
            output=reply.output if capped else cap_output(reply.output, ctx.output_max_bytes),
            duration_ms=int((time.monotonic() - started) * 1000),
        )

    def reply(self, tool: str, raw_input: dict[str, Any] | str, ctx: ToolContext) -> ToolReply:
        """The call's reply, uncapped: where the tool's registration says it runs."""
        entry = self._tools.get(tool)
        if entry is None:
            offered = ", ".join(sorted(self._tools)) or "none"
            return ToolReply(f"unknown tool {tool!r}; this machine offers: {offered}", "invalid")
        parsed = parse_input(tool, raw_input)
        if isinstance(parsed, ToolReply):
            return parsed
        try:
            args = entry.model.model_validate(parsed)
        except ValidationError as exc:
            return ToolReply(f"invalid arguments for {tool}: {compact_errors(exc)}", "invalid")
        if ctx.cancelled.is_set():
            return ToolReply(f"{tool} not started: the run was cancelled", "cancelled")
        if ctx.remaining_s() <= 0:
            return ToolReply(f"{tool} not started: the deadline has passed", "timeout")
        jailed = ctx.jail is not None and ctx.jail.bwrap is not None
        if entry.sandbox is True and jailed and self._jail_runner is not None:
            return self._jail_runner(tool, parsed, ctx)
        try:
            result = entry.fn(args, ctx)
        except Exception as exc:  # a tool failure is data for the model, not a crash
            return ToolReply(f"{type(exc).__name__}: {exc}", "error")
        return result if isinstance(result, ToolReply) else ToolReply(as_text(result))


def parse_input(tool: str, raw_input: object) -> dict[str, Any] | ToolReply:
    """The call's arguments as a dict without the routing key, or an "invalid" reply."""
    data = raw_input
    if isinstance(raw_input, str | bytes):
        try:
            data = json.loads(raw_input)
        except ValueError as exc:
            return ToolReply(f"invalid JSON input for {tool}: {exc}", "invalid")
    if not isinstance(data, dict):
        kind = type(data).__name__
        return ToolReply(f"invalid input for {tool}: expected a JSON object, got {kind}", "invalid")
    return {key: value for key, value in data.items() if key != ROUTING_KEY}


def compact_errors(exc: ValidationError) -> str:
    """`path: Field required; limit: Input should be a valid integer` — one part per field."""
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else error["msg"])
    return "; ".join(parts)


def as_text(value: object) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    return value if isinstance(value, str) else str(value)


def clean_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema without pydantic's generated `title` keys (noise for the model)."""
    return _without_titles(schema)  # type: ignore[no-any-return]


def _without_titles(node: Any, *, in_properties: bool = False) -> Any:
    if isinstance(node, list):
        return [_without_titles(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {
        key: _without_titles(value, in_properties=key == "properties" and not in_properties)
        for key, value in node.items()
        if in_properties or key != "title"
    }


def _args_model(fn: Callable[..., Any]) -> type[BaseModel]:
    params = list(inspect.signature(fn).parameters)
    if len(params) != 2:
        raise TypeError(f"tool {fn.__name__!r} must take (args, ctx)")
    hint = typing.get_type_hints(fn).get(params[0])
    if not (isinstance(hint, type) and issubclass(hint, BaseModel)):
        raise TypeError(f"tool {fn.__name__!r}: annotate `{params[0]}` with a pydantic model")
    return hint


def register_builtins(registry: ToolRegistry) -> ToolRegistry:
    """Add the built-in tools every machine offers (`builtin`) to `registry`."""
    # "self": each confines its own work through `ctx.jail` (a command, a file server).
    registry.tool(tags=("system",), core=True, sandbox="self")(execute_command)
    registry.tool(tags=("fileread",), core=True, sandbox="self")(read_file)
    registry.tool(tags=("system",), sandbox="self")(write_file)
    registry.tool(tags=("fileread",), sandbox="self")(list_dir)
    registry.tool(tags=("fileread",), sandbox="self")(grep)
    registry.tool(tags=("fileread",), sandbox="self")(glob)
    return registry


_DEFAULT = ToolRegistry(jail_runner=run_user_tool)
_DEFAULT_LOCK = threading.Lock()
_builtins_loaded = False

tool = _DEFAULT.tool
"""Register a tool on the default registry (the one machine workers serve)."""


def default_registry() -> ToolRegistry:
    """The process-wide registry: the built-ins plus every tool added with `@tool`."""
    global _builtins_loaded
    with _DEFAULT_LOCK:
        if not _builtins_loaded:
            register_builtins(_DEFAULT)
            _builtins_loaded = True
    return _DEFAULT


def load_tool_modules(modules: Sequence[str]) -> ToolRegistry:
    """Import the operator's tool modules here, and have the sandboxed tool servers
    import the same ones; the default registry, with their tools."""
    for module in modules:
        importlib.import_module(module)
    host(modules)
    return default_registry()
