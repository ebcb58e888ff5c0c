"""ToolRegistry.run and the built-in tools, driven the way the machine task drives them."""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from cmdop_worker.core.tools import cap_output
from cmdop_worker.machine import builtin, fileops, filesearch
from cmdop_worker.machine.builtin import command_timeout_s
from cmdop_worker.machine.fileops import current_umask
from cmdop_worker.machine.process import fair_shares
from cmdop_worker.machine.registry import (
    ToolContext,
    ToolRegistry,
    ToolReply,
    default_registry,
    register_builtins,
    tool,
)
from cmdop_worker.models import ToolOutcome
from tests.procs import gone_within

BUILTINS = register_builtins(ToolRegistry())


def make_ctx(
    *, deadline_s: float = 10.0, max_bytes: int = 64_000, cancelled: threading.Event | None = None
) -> ToolContext:
    return ToolContext(
        machine="web-1",
        run_id="run-1",
        tool_use_id="toolu_1",
        deadline_monotonic=time.monotonic() + deadline_s,
        cancelled=cancelled or threading.Event(),
        output_max_bytes=max_bytes,
    )


def run(tool_name: str, raw: dict[str, Any] | str, **ctx: Any) -> ToolOutcome:
    return BUILTINS.run(tool_name, raw, make_ctx(**ctx))


# --- a user-registered tool --------------------------------------------------------


class EchoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(description="What to say back.")
    times: int = Field(default=1, ge=1)


def user_registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(tags=("meta", "demo"), core=True)
    def echo(args: EchoArgs, ctx: ToolContext) -> str:
        """Say the text back."""
        return args.text * args.times

    @registry.tool(name="explode", description="Always fails.")
    def explode_tool(args: EchoArgs, ctx: ToolContext) -> str:
        raise RuntimeError(f"boom: {args.text}")

    @registry.tool()
    def judge(args: EchoArgs, ctx: ToolContext) -> ToolReply:
        """Replies with its own status."""
        return ToolReply(f"verdict {args.text}", "timeout" if args.text == "slow" else "ok")

    @registry.tool()
    def raw(args: EchoArgs, ctx: ToolContext) -> Any:
        """Returns bytes."""
        return args.text.encode() + b"\x00\xff!"

    return registry


def test_user_tool_spec() -> None:
    specs = {spec.name: spec for spec in user_registry().specs()}
    assert list(specs) == ["echo", "explode", "judge", "raw"]
    echo = specs["echo"]
    assert (echo.description, echo.tags, echo.core, echo.machine_bound) == (
        "Say the text back.",
        ("meta", "demo"),
        True,
        True,
    )
    assert specs["explode"].description == "Always fails."
    assert echo.input_schema == {
        "type": "object",
        "properties": {
            "text": {"type": "string", "description": "What to say back."},
            "times": {"type": "integer", "default": 1, "minimum": 1},
        },
        "required": ["text"],
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    ("tool_name", "raw", "status", "output"),
    [
        ("echo", {"text": "ab", "times": 2}, "ok", "abab"),
        ("echo", '{"text": "x"}', "ok", "x"),
        ("echo", {"text": "x", "machine": "web-1"}, "ok", "x"),
        ("judge", {"text": "slow"}, "timeout", "verdict slow"),
        ("judge", {"text": "fine"}, "ok", "verdict fine"),
        ("raw", {"text": "hi"}, "ok", "hi\ufffd!"),
        ("explode", {"text": "x"}, "error", "RuntimeError: boom: x"),
        ("nope", {}, "invalid", "unknown tool 'nope'; this machine offers: echo, explode, ..."),
        ("echo", {}, "invalid", "invalid arguments for echo: text: Field required"),
        (
            "echo",
            {"text": "x", "bogus": 1},
            "invalid",
            "invalid arguments for echo: bogus: Extra inputs are not permitted",
        ),
        (
            "echo",
            {"text": 5, "times": 0},
            "invalid",
            "invalid arguments for echo: text: Input should be a valid string; "
            "times: Input should be greater than or equal to 1",
        ),
        ("echo", '{"text": ', "invalid", "invalid JSON input for echo: Expecting value: ..."),
        ("echo", "[1, 2]", "invalid", "invalid input for echo: expected a JSON object, got list"),
    ],
)
def test_registry_run(tool_name: str, raw: Any, status: str, output: str) -> None:
    outcome = user_registry().run(tool_name, raw, make_ctx())
    assert (outcome.tool_use_id, outcome.tool, outcome.machine) == ("toolu_1", tool_name, "web-1")
    assert outcome.status == status
    if output.endswith("..."):
        assert outcome.output.startswith(output[:-3])
    else:
        assert outcome.output == output


def test_run_refuses_to_start_after_cancel_or_deadline() -> None:
    cancelled = threading.Event()
    cancelled.set()
    registry = user_registry()
    assert registry.run("echo", {"text": "x"}, make_ctx(cancelled=cancelled)).status == "cancelled"
    assert registry.run("echo", {"text": "x"}, make_ctx(deadline_s=-1)).status == "timeout"


@pytest.mark.parametrize(
    ("output", "cap", "expected"),
    [
        ("x" * 100, 10, "x" * 10 + "\n[output truncated: 100 bytes, showing first 10]"),
        ("short", 10, "short"),
        ("é" * 5, 5, "éé\n[output truncated: 10 bytes, showing first 5]"),
        ("a\x00b", 10, "ab"),
        (b"\xffok", 10, "\ufffdok"),
        ("lone \udc80 surrogate", 100, "lone ? surrogate"),
    ],
)
def test_cap_output(output: str | bytes, cap: int, expected: str) -> None:
    assert cap_output(output, cap) == expected


def test_output_cap_applies_to_run() -> None:
    outcome = user_registry().run("echo", {"text": "y", "times": 70_000}, make_ctx())
    assert outcome.output.endswith("\n[output truncated: 70000 bytes, showing first 64000]")


def test_registration_errors() -> None:
    registry = user_registry()

    def echo(args: EchoArgs, ctx: ToolContext) -> str:
        return ""

    with pytest.raises(ValueError, match="already registered"):
        registry.tool()(echo)

    def untyped(args, ctx):  # type: ignore[no-untyped-def]
        return ""

    with pytest.raises(TypeError, match="pydantic model"):
        registry.tool()(untyped)


def test_default_registry_has_builtins_and_module_level_tool() -> None:
    @tool(name="test_only_default_echo", tags=("meta",))
    def _echo(args: EchoArgs, ctx: ToolContext) -> str:
        return args.text

    registry = default_registry()
    assert registry is default_registry()
    assert {"execute_command", "read_file", "write_file", "list_dir", "grep", "glob"} <= set(
        registry.names()
    )
    assert registry.run("test_only_default_echo", {"text": "hi"}, make_ctx()).output == "hi"


@pytest.mark.parametrize(
    ("name", "tags", "core"),
    [
        ("execute_command", ("system",), True),
        ("read_file", ("fileread",), True),
        ("write_file", ("system",), False),
        ("list_dir", ("fileread",), False),
        ("grep", ("fileread",), False),
        ("glob", ("fileread",), False),
    ],
)
def test_builtin_specs(name: str, tags: tuple[str, ...], core: bool) -> None:
    spec = next(spec for spec in BUILTINS.specs() if spec.name == name)
    assert (spec.tags, spec.core, spec.machine_bound) == (tags, core, True)
    assert spec.description and spec.input_schema["additionalProperties"] is False
    assert "machine" not in spec.input_schema["properties"]


# --- execute_command ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "status", "output"),
    [
        ("echo hi", "ok", "exit_code: 0\n--- stdout ---\nhi"),
        ("echo err >&2", "ok", "exit_code: 0\n--- stderr ---\nerr"),
        ("true", "ok", "exit_code: 0"),
        (
            "echo a; echo b >&2; exit 2",
            "error",
            "exit_code: 2\n--- stdout ---\na\n--- stderr ---\nb",
        ),
        (r"printf 'x\377\000y'", "ok", "exit_code: 0\n--- stdout ---\nx\ufffdy"),
    ],
)
def test_execute_command(command: str, status: str, output: str) -> None:
    outcome = run("execute_command", {"command": command, "machine": "web-1"})
    assert (outcome.status, outcome.output) == (status, output)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        # One stream gets the whole budget (1000 - 256 reserved for markers).
        (
            "head -c 5000 /dev/zero | tr '\\0' a",
            "exit_code: 0\n--- stdout ---\n"
            + "a" * 744
            + "\n[stdout truncated: 4256 more bytes dropped]",
        ),
        # Two big streams share it evenly.
        (
            "head -c 5000 /dev/zero | tr '\\0' a; head -c 5000 /dev/zero | tr '\\0' b >&2",
            "exit_code: 0\n--- stdout ---\n"
            + "a" * 372
            + "\n[stdout truncated: 4628 more bytes dropped]\n--- stderr ---\n"
            + "b" * 372
            + "\n[stderr truncated: 4628 more bytes dropped]",
        ),
        # A small stream keeps everything; the big one gets the rest.
        (
            "echo warn >&2; head -c 5000 /dev/zero | tr '\\0' a",
            "exit_code: 0\n--- stdout ---\n"
            + "a" * 739
            + "\n[stdout truncated: 4261 more bytes dropped]\n--- stderr ---\nwarn",
        ),
    ],
)
def test_execute_command_truncation_markers(command: str, expected: str) -> None:
    outcome = run("execute_command", {"command": command}, max_bytes=1000)
    assert outcome.output == expected
    assert len(outcome.output.encode()) <= 1000


def test_tiny_cap_still_marks_truncation() -> None:
    outcome = run("execute_command", {"command": "seq 1 1000"}, max_bytes=50)
    assert outcome.output.endswith(", showing first 50]")


@pytest.mark.parametrize(
    ("sizes", "budget", "expected"),
    [([10, 10], 100, [10, 10]), ([500, 500], 100, [50, 50]), ([5, 500], 100, [5, 95]), ([], 9, [])],
)
def test_fair_shares(sizes: list[int], budget: int, expected: list[int]) -> None:
    assert fair_shares(sizes, budget) == expected


def killed_pid_gone(output: str) -> bool:
    """The background sleep whose pid the command echoed is gone (or a zombie)."""
    pid = int(output.split("--- stdout ---\n", 1)[1].split()[0])
    return gone_within(pid, 5)


SLEEPER = "sleep 30 & echo $!; wait"


def test_execute_command_timeout() -> None:
    outcome = run("execute_command", {"command": SLEEPER, "timeout_ms": 100})
    assert outcome.status == "timeout"
    assert re.match(r"timed out after \d+ ms; process group killed\n", outcome.output)
    assert killed_pid_gone(outcome.output)


def test_execute_command_stops_at_the_run_deadline() -> None:
    # The command's own timeout is the 120 s default: only the run deadline can stop it.
    outcome = run("execute_command", {"command": SLEEPER}, deadline_s=0.15)
    assert outcome.status == "timeout"
    assert killed_pid_gone(outcome.output)


def test_execute_command_cancel(tmp_path: Path) -> None:
    started = tmp_path / "started"
    cancelled = threading.Event()

    def cancel_once_running() -> None:
        end = time.monotonic() + 20
        while not started.exists() and time.monotonic() < end:
            time.sleep(0.01)
        cancelled.set()

    canceller = threading.Thread(target=cancel_once_running)
    canceller.start()
    command = f"sleep 30 & echo $!; touch {started}; wait"
    outcome = run("execute_command", {"command": command}, cancelled=cancelled)
    canceller.join()
    assert outcome.status == "cancelled"
    assert re.match(r"cancelled after \d+ ms; process group killed\n", outcome.output)
    assert killed_pid_gone(outcome.output)


@pytest.mark.parametrize(
    ("timeout_ms", "remaining_s", "expected_s"),
    [
        (None, 1_000.0, 120.0),
        (2_500, 1_000.0, 2.5),
        (0, 1_000.0, 0.001),
        (-50, 1_000.0, 0.001),
        (10**9, 1_000.0, 600.0),
        (None, 0.5, 0.5),
        (None, -3.0, 0.001),
    ],
)
def test_command_timeout_clamp(
    timeout_ms: int | None, remaining_s: float, expected_s: float
) -> None:
    assert command_timeout_s(timeout_ms, remaining_s) == pytest.approx(expected_s)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "invalid arguments for execute_command: command: Field required"),
        ({"command": ""}, "command: String should have at least 1 character"),
        ({"command": "ls", "timeout_ms": "soon"}, "timeout_ms: Input should be a valid integer"),
        ({"command": "ls", "cwd": "/"}, "cwd: Extra inputs are not permitted"),
    ],
)
def test_execute_command_invalid(raw: dict[str, Any], message: str) -> None:
    outcome = run("execute_command", raw)
    assert outcome.status == "invalid" and message in outcome.output


# --- file tools --------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """cwd and HOME at a small tree with text, binary and protected files."""
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text("import os\nprint('TODO one')\n")
    (tmp_path / "src" / "pkg" / "b.py").write_text("# TODO two\n")
    (tmp_path / "src" / "blob.bin").write_bytes(b"TODO\x00\x01")
    (tmp_path / "notes.txt").write_text("".join(f"line {n}\n" for n in range(1, 6)))
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".env").write_text("TODO=secret\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("TODO ref\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("raw", "status", "output"),
    [
        ({"path": "notes.txt"}, "ok", "".join(f"     {n}\tline {n}\n" for n in range(1, 6))[:-1]),
        (
            {"path": "~/notes.txt", "offset": 1, "limit": 2},
            "ok",
            "     2\tline 2\n     3\tline 3\n[more lines follow; continue with offset=3]",
        ),
        ({"path": "notes.txt", "offset": 4}, "ok", "     5\tline 5"),
        ({"path": "notes.txt", "offset": 9}, "ok", "(no lines after offset 9; 5 lines)"),
        ({"path": "empty.txt"}, "ok", "(empty file)"),
        ({"path": "bad.txt"}, "ok", "     1\tcaf\ufffd"),
        ({"path": "src/blob.bin"}, "ok", "binary file src/blob.bin (6 bytes); content not shown"),
        ({"path": "missing.txt"}, "error", "FileNotFoundError: [Errno 2] No such file or dir..."),
        ({"path": "src"}, "error", "IsADirectoryError: ..."),
        ({}, "invalid", "invalid arguments for read_file: path: Field required"),
        ({"path": "x", "offset": -1}, "invalid", "invalid arguments for read_file: offset: ..."),
        ({"path": "x", "lines": 3}, "invalid", "invalid arguments for read_file: lines: Extra..."),
    ],
)
def test_read_file(tree: Path, raw: dict[str, Any], status: str, output: str) -> None:
    outcome = run("read_file", raw)
    assert outcome.status == status
    if output.endswith("..."):
        assert outcome.output.startswith(output[:-3]), outcome.output
    else:
        assert outcome.output == output


def temp_leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_write_file_creates_with_parents_and_umask_mode(tree: Path) -> None:
    outcome = run("write_file", {"path": "new/deep/f.txt", "content": "héllo"})
    target = tree / "new" / "deep" / "f.txt"
    assert (outcome.status, outcome.output) == ("ok", "wrote 6 bytes to new/deep/f.txt (created)")
    assert target.read_text() == "héllo"
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~current_umask()
    assert temp_leftovers(target.parent) == []


def test_write_file_replaces_and_keeps_mode(tree: Path) -> None:
    target = tree / "notes.txt"
    target.chmod(0o640)
    outcome = run("write_file", {"path": str(target), "content": "new\n"})
    assert outcome.status == "ok" and outcome.output.endswith("(replaced)")
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert temp_leftovers(tree) == []


def test_write_file_never_writes_through_a_symlink(tree: Path) -> None:
    (tree / "link.txt").symlink_to(tree / "notes.txt")
    before = (tree / "notes.txt").read_text()
    outcome = run("write_file", {"path": "link.txt", "content": "via link"})
    assert outcome.status == "error" and "symlink" in outcome.output
    assert (tree / "link.txt").is_symlink()
    assert (tree / "notes.txt").read_text() == before


def test_write_file_failure_leaves_no_temp(tree: Path) -> None:
    outcome = run("write_file", {"path": "src", "content": "x"})
    assert outcome.status == "error" and outcome.output.startswith("IsADirectoryError")
    assert temp_leftovers(tree) == []


def test_list_dir(tree: Path) -> None:
    (tree / "dangling").symlink_to(tree / "nowhere")
    outcome = run("list_dir", {"path": "~"})
    assert outcome.status == "ok"
    assert outcome.output.splitlines() == [
        f"{tree} (7 entries)",
        "          12  .env",
        "           -  .git/",
        "           5  bad.txt",
        f"           ?  dangling -> {tree}/nowhere",
        "           0  empty.txt",
        "          35  notes.txt",
        "           -  src/",
    ]


def test_list_dir_cap(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fileops, "MAX_DIR_ENTRIES", 2)
    lines = run("list_dir", {"path": "."}).output.splitlines()
    assert lines == [
        ". (6 entries)",
        "          12  .env",
        "           -  .git/",
        "[4 more entries not shown]",
    ]


@pytest.mark.parametrize(
    ("path", "error"), [("missing", "FileNotFoundError"), ("notes.txt", "NotADirectoryError")]
)
def test_list_dir_errors(tree: Path, path: str, error: str) -> None:
    outcome = run("list_dir", {"path": path})
    assert outcome.status == "error" and outcome.output.startswith(error)


@pytest.mark.parametrize(
    ("raw", "status", "output"),
    [
        (
            {"pattern": "TODO", "path": "."},
            "ok",
            "./src/a.py:2: print('TODO one')\n./src/pkg/b.py:1: # TODO two",
        ),
        ({"pattern": r"^import\s", "path": "src/a.py"}, "ok", "src/a.py:1: import os"),
        ({"pattern": "caf.", "path": "bad.txt"}, "ok", "bad.txt:1: caf\ufffd"),
        ({"pattern": "nothing here", "path": "src"}, "ok", "no matches for 'nothing here'"),
        ({"pattern": "(", "path": "."}, "invalid", "invalid regex '(': missing ): ( (grep uses..."),
        ({"pattern": "x", "path": "missing"}, "error", "FileNotFoundError: no such file or..."),
        ({"pattern": "x"}, "invalid", "invalid arguments for grep: path: Field required"),
    ],
)
def test_grep(tree: Path, raw: dict[str, Any], status: str, output: str) -> None:
    outcome = run("grep", raw)
    assert outcome.status == status
    if output.endswith("..."):
        assert outcome.output.startswith(output[:-3]), outcome.output
    else:
        assert outcome.output == output


def test_grep_caps_matches(tree: Path) -> None:
    (tree / "many.txt").write_text("hit\n" * 600)
    lines = run("grep", {"pattern": "hit", "path": "many.txt"}).output.splitlines()
    assert len(lines) == 501
    assert lines[-1] == "[match limit 500 reached; narrow the pattern or path]"


def test_grep_stops_when_cancelled_or_late(tree: Path) -> None:
    args = builtin.GrepArgs(pattern="x", path=".")
    cancelled = threading.Event()
    cancelled.set()
    assert builtin.grep(args, make_ctx(cancelled=cancelled)).status == "cancelled"
    assert builtin.grep(args, make_ctx(deadline_s=-1)).status == "timeout"


@pytest.mark.parametrize(
    ("raw", "output"),
    [
        ({"pattern": "**/*.py"}, "src/a.py\nsrc/pkg/b.py"),
        ({"pattern": "*.py", "path": "src"}, "src/a.py"),
        (
            {"pattern": "*", "path": "~/src"},
            "{tree}/src/a.py\n{tree}/src/blob.bin\n{tree}/src/pkg/",
        ),
        ({"pattern": "{tree}/src/*.py"}, "{tree}/src/a.py"),
        ({"pattern": "*"}, "bad.txt\nempty.txt\nnotes.txt\nsrc/"),
        ({"pattern": "*.rs"}, "no paths match '*.rs' under ."),
    ],
)
def test_glob(tree: Path, raw: dict[str, Any], output: str) -> None:
    raw = {key: value.replace("{tree}", str(tree)) for key, value in raw.items()}
    outcome = run("glob", raw)
    assert (outcome.status, outcome.output) == ("ok", output.replace("{tree}", str(tree)))


def test_glob_cap_and_errors(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filesearch, "MAX_GLOB_MATCHES", 2)
    assert run("glob", {"pattern": "*"}).output == "bad.txt\nempty.txt\n[2 more matches not shown]"
    outcome = run("glob", {"pattern": "*", "path": "notes.txt"})
    assert outcome.status == "error" and outcome.output.startswith("NotADirectoryError")


def test_json_string_input_for_builtin(tree: Path) -> None:
    outcome = run("read_file", json.dumps({"path": "notes.txt", "limit": 1, "machine": "web-1"}))
    assert outcome.status == "ok" and outcome.output.startswith("     1\tline 1\n[more lines")


def test_umask_reader_matches_os() -> None:
    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027
    finally:
        os.umask(old)
