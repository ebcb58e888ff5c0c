"""The machine side's tool registry: typed tools in, `ToolOutcome` values out.

The registry itself (`ToolRegistry`, `ToolContext`, `ToolReply`) is in `toolbox` and
re-exported here, so a tool module needs one import line.

Who calls it: the machine worker's Celery task (`default_registry().run(...)`) and
presence (`.specs()`). Users add tools to the default registry with the module-level
decorator::

    from cmdop_worker.machine.registry import ToolContext, tool

    class DiskArgs(BaseModel):
        mount: str = "/"

    @tool(tags=("system",), description="Free space on a mount")
    def disk_free(args: DiskArgs, ctx: ToolContext) -> str: ...

Such a tool runs in the call's sandbox (`tooljail`), as a command does, unless it is
registered with `sandbox=False`: then it runs in the worker's own process, with the
worker's rights, and the worker names it in a warning at start and in its presence.
`load_tool_modules` imports the operator's modules (`CMDOP_TOOL_MODULES`) and tells
the sandboxed tool servers to import them too.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence

from cmdop_worker.machine.builtin import register_builtins
from cmdop_worker.machine.toolbox import ToolContext, ToolRegistry, ToolReply
from cmdop_worker.machine.tooljail import host, run_user_tool

__all__ = [
    "ToolContext",
    "ToolRegistry",
    "ToolReply",
    "default_registry",
    "load_tool_modules",
    "tool",
]

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
