"""The built-in tools every machine offers: a shell command and the file tools.

`registry.register_builtins` adds them to a registry (`registry.default_registry()`
once, to the process-wide one). Each tool's input model forbids unknown keys (the
registry strips the `machine` routing key first). Paths expand `~`; relative paths
are relative to the worker's working directory.

A command runs in the call's sandbox (`process.run_command`); so do the file tools,
through a sandboxed file server (`filejail`), which does the reading and writing
(`fileops`, `filesearch`). Permission decisions are made before `run`, not here.
"""

from __future__ import annotations

from typing import cast

from pydantic import BaseModel, ConfigDict, Field

from cmdop_worker.core.routing import clamp_timeout_ms
from cmdop_worker.machine.filejail import run_file_tool
from cmdop_worker.machine.fileops import DEFAULT_READ_LIMIT, check_write_size
from cmdop_worker.machine.process import ProcessResult, run_command
from cmdop_worker.machine.toolcall import ToolContext, ToolReply
from cmdop_worker.models import ToolStatus

DEFAULT_TIMEOUT_MS = 120_000


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExecuteCommandArgs(_Args):
    command: str = Field(min_length=1, description="Shell command line (run with `bash -c`).")
    timeout_ms: int | None = Field(
        default=None, description="Kill the command after this many ms (1-600000, default 120000)."
    )


class ReadFileArgs(_Args):
    path: str = Field(min_length=1, description="File to read; `~` expands.")
    offset: int = Field(default=0, ge=0, description="Number of lines to skip.")
    limit: int | None = Field(default=DEFAULT_READ_LIMIT, ge=1, description="Lines to show.")


class WriteFileArgs(_Args):
    path: str = Field(min_length=1, description="File to create or replace.")
    content: str = Field(description="The whole new content (UTF-8).")


class ListDirArgs(_Args):
    path: str = Field(min_length=1, description="Directory to list.")


class GrepArgs(_Args):
    pattern: str = Field(
        min_length=1,
        description=(
            "Regular expression in RE2 syntax (Python's `re` without backreferences "
            "or lookaround; `\\w`, `\\d`, `\\s` match ASCII only)."
        ),
    )
    path: str = Field(min_length=1, description="File, or directory searched recursively.")


class GlobArgs(_Args):
    pattern: str = Field(min_length=1, description="Glob such as `**/*.py` (`**` recurses).")
    path: str | None = Field(default=None, description="Base directory (default: cwd).")


def execute_command(args: ExecuteCommandArgs, ctx: ToolContext) -> ToolReply:
    """Run a shell command on the machine; returns its exit code, stdout and stderr."""
    timeout_s = command_timeout_s(args.timeout_ms, ctx.remaining_s())
    result = run_command(
        args.command,
        timeout_s=timeout_s,
        cancelled=ctx.cancelled,
        max_bytes=ctx.output_max_bytes,
        cwd=ctx.cwd,
        jail=ctx.jail,
    )
    return ToolReply(result.summary(ctx.output_max_bytes), command_status(result))


def command_timeout_s(timeout_ms: int | None, remaining_s: float) -> float:
    """The asked timeout clamped to [1 ms, 600 s] (default 120 s), never past the deadline."""
    clamped_ms = clamp_timeout_ms(timeout_ms, DEFAULT_TIMEOUT_MS)
    return max(0.001, min(clamped_ms / 1000, remaining_s))


def command_status(result: ProcessResult) -> ToolStatus:
    if result.cancelled:
        return "cancelled"
    if result.timed_out:
        return "timeout"
    return "ok" if result.exit_code == 0 else "error"


def read_file(args: ReadFileArgs, ctx: ToolContext) -> ToolReply:
    """Read a text file; lines are numbered like `cat -n`. Use offset/limit to page."""
    return file_call("read_file", args, ctx)


def write_file(args: WriteFileArgs, ctx: ToolContext) -> ToolReply:
    """Create or replace a file atomically (parent directories are created)."""
    # Checked here too, so an oversized content never travels to the file server.
    check_write_size(len(args.content.encode("utf-8", errors="surrogatepass")))
    return file_call("write_file", args, ctx)


def list_dir(args: ListDirArgs, ctx: ToolContext) -> ToolReply:
    """List a directory: sorted entries, directories end with `/`, files show their size."""
    return file_call("list_dir", args, ctx)


def grep(args: GrepArgs, ctx: ToolContext) -> ToolReply:
    """Search files for a Python regex; prints `path:line: text`. Skips binary files."""
    return file_call("grep", args, ctx)


def glob(args: GlobArgs, ctx: ToolContext) -> ToolReply:
    """Find paths matching a glob pattern (`**` matches any depth); sorted."""
    return file_call("glob", args, ctx)


def file_call(tool: str, args: BaseModel, ctx: ToolContext) -> ToolReply:
    """The file tool run where the call's commands would run (`filejail`)."""
    reply = run_file_tool(tool, args.model_dump(), ctx)
    return ToolReply(reply.output, cast(ToolStatus, reply.status))
