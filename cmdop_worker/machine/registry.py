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
"""

from __future__ import annotations

import threading

from cmdop_worker.machine.builtin import register_builtins
from cmdop_worker.machine.toolbox import ToolContext, ToolRegistry, ToolReply

__all__ = ["ToolContext", "ToolRegistry", "ToolReply", "default_registry", "tool"]

_DEFAULT = ToolRegistry()
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
