"""Tools the benchmark fleets load through `CMDOP_TOOL_MODULES=["bench.tools"]`.

`bench_noop` returns at once: a turn of no-op calls measures the loop, not a shell.
`bench_sleep` waits `ms` milliseconds (ending early on a ui cancel), the same body the
in-process peers run (`bench.loops`), so the peers comparison compares loops, not
tools; its `note` is there only to give a call an input of a real call's size.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cmdop_worker.machine.registry import ToolContext, tool


class NoopArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SleepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ms: int = Field(ge=0, le=60_000, description="How long to wait, in ms.")
    # What the step is for, as a model writes beside a command; it sizes the call's
    # input (the paced fake model's time to write it), nothing else.
    note: str = Field(default="", max_length=500, description="What this step is for.")


@tool(name="bench_noop", description="Do nothing and return at once.")
def bench_noop(args: NoopArgs, ctx: ToolContext) -> str:
    return "ok"


@tool(name="bench_sleep", description="Wait `ms` milliseconds.")
def bench_sleep(args: SleepArgs, ctx: ToolContext) -> str:
    ctx.cancelled.wait(args.ms / 1000)
    return f"slept {args.ms} ms"
