"""What both sides of a tool call know of tools, with no I/O.

The coordinator routes and catalogues tools without importing the machine side, and
the machine side caps output without importing the coordinator; the names they share
live here: the built-in machine tools, the coordinator's own tools (`list_machines`,
`ask_machine`, `ask_machines`) with their specs and timeout arguments, and the one rule
for capping a tool's output.
"""

from __future__ import annotations

from cmdop_worker.models import ToolSpec

BUILTIN_MACHINE_TOOLS = frozenset(
    {"execute_command", "read_file", "write_file", "list_dir", "grep", "glob"}
)
ASK_TIMEOUT_DEFAULT_MS = 120_000
ASK_MANY_HOST_MAX_MS = 300_000
ASK_MANY_TOTAL_DEFAULT_MS = 240_000
ASK_MANY_MAX_HOSTS = 32  # child runs one ask_machines call may start
TIMEOUT_ARGS = {
    "ask_machine": ("timeout_ms", ASK_TIMEOUT_DEFAULT_MS),
    "ask_machines": ("total_timeout_ms", ASK_MANY_TOTAL_DEFAULT_MS),
}

_HOST = {"type": "string", "pattern": "^[a-z0-9][a-z0-9._-]{0,62}$"}
SPECS = [
    ToolSpec(
        name="list_machines",
        description=(
            "List the machines of the fleet that are online, with their labels and the tools "
            "each offers; a label selector keeps those it matches."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "selector": {
                    "type": "string",
                    "description": "a Kubernetes label selector: role=web,env!=staging, "
                    "region in (eu,us), !canary, or * for every machine (the default)",
                }
            },
            "additionalProperties": False,
        },
        tags=("remote",),
        core=True,
        machine_bound=False,
    ),
    ToolSpec(
        name="ask_machine",
        description="Hand a sub-task to the operator on another machine and return its answer.",
        input_schema={
            "type": "object",
            "properties": {
                "machine": _HOST,
                "prompt": {"type": "string"},
                "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 600_000},
            },
            "required": ["machine", "prompt"],
        },
        tags=("remote",),
        machine_bound=False,
    ),
    ToolSpec(
        name="ask_machines",
        description=(
            "Ask the operators on several machines the same thing, in parallel: each machine "
            "gets its own agent run, which reasons and acts there, and answers. For when each "
            "machine needs its own reasoning; for the same command or tool call everywhere, "
            "give that tool `machines` (a selector) instead: one call, no model calls."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "machines": {
                    "description": "machine names, or a label selector (role=web, "
                    "region in (eu,us), * for every machine)",
                    "anyOf": [
                        {
                            "type": "array",
                            "items": _HOST,
                            "minItems": 1,
                            "maxItems": ASK_MANY_MAX_HOSTS,
                        },
                        {"type": "string", "minLength": 1},
                    ],
                },
                "prompt": {"type": "string"},
                "timeout_ms": {"type": "integer", "minimum": 1000, "maximum": 300_000},
                "total_timeout_ms": {"type": "integer", "minimum": 1000, "maximum": 600_000},
            },
            "required": ["machines", "prompt"],
        },
        tags=("remote",),
        machine_bound=False,
    ),
]
NAMES = frozenset(spec.name for spec in SPECS)


def cap_output(output: str | bytes, max_bytes: int) -> str:
    """Valid UTF-8 text without NULs, at most `max_bytes` bytes plus a truncation marker."""
    data = output.encode("utf-8", errors="replace") if isinstance(output, str) else output
    data = data.replace(b"\x00", b"")
    if len(data) <= max_bytes:
        return data.decode("utf-8", errors="replace")
    # "ignore" only drops the character the cut split in two.
    head = data[:max_bytes].decode("utf-8", errors="ignore")
    return f"{head}\n[output truncated: {len(data)} bytes, showing first {max_bytes}]"
