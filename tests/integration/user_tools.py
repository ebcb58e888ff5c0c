"""A user-registered machine tool, loaded by a test machine worker through
`CMDOP_TOOL_MODULES='["tests.integration.user_tools"]'`.

Never imported by the test process itself: the tool must reach the model only through
the worker's presence, as a user's own tool would.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cmdop_worker.machine.registry import ToolContext, tool


class ShoutArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1, description="What to shout.")
    times: int = Field(default=1, ge=1, le=5, description="How many times (1-5).")


@tool(tags=("custom",), core=True)
def shout(args: ShoutArgs, ctx: ToolContext) -> str:
    """Upper-case the text, repeated, and say which machine shouted it."""
    return " ".join([args.text.upper()] * args.times) + f" (on {ctx.machine})"
