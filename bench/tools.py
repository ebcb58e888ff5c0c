"""Tools the benchmark fleets load through `CMDOP_TOOL_MODULES=["bench.tools"]`.

`bench_noop` returns at once: a turn of no-op calls measures the loop, not a shell.
`bench_sleep` waits `ms` milliseconds (ending early on a ui cancel), the same body the
in-process peers run, so the peers comparison compares loops, not tools.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cmdop_worker.machine.registry import ToolContext, tool


class NoopArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SleepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ms: int = Field(ge=0, le=60_000, description="How long to wait, in ms.")


@tool(name="bench_noop", description="Do nothing and return at once.")
def bench_noop(args: NoopArgs, ctx: ToolContext) -> str:
    return "ok"


@tool(name="bench_sleep", description="Wait `ms` milliseconds.")
def bench_sleep(args: SleepArgs, ctx: ToolContext) -> str:
    ctx.cancelled.wait(args.ms / 1000)
    return f"slept {args.ms} ms"
