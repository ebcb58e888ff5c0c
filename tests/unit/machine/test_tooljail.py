"""The operator's `@tool` functions in the call's sandbox (`tooljail`, `toolserve`),
through the default registry, a real bubblewrap and real tool servers."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from cmdop_worker.machine import filejail
from cmdop_worker.machine.filejail import jail_key, pool
from cmdop_worker.machine.fileproc import Hosting, server_argv
from cmdop_worker.machine.registry import ToolContext, ToolRegistry, load_tool_modules
from cmdop_worker.machine.sandbox import Confinement, find_bwrap, tool_env
from cmdop_worker.machine.tooljail import host, import_roots, python_path

BWRAP = find_bwrap()
needs_bwrap = pytest.mark.skipif(BWRAP is None, reason="no bwrap binary")
MODULE = "tests.integration.jail_tools"
REPO = str(Path(__file__).resolve().parents[3])


def jail(*writable: str) -> Confinement:
    return Confinement(bwrap=BWRAP, writable=writable, env=tool_env(os.environ))


def ctx(box: Confinement | None) -> ToolContext:
    return ToolContext("m", "r", "t", time.monotonic() + 20, threading.Event(), cwd=REPO, jail=box)


@pytest.fixture(scope="module")
def registry() -> ToolRegistry:
    return load_tool_modules([MODULE])


def test_a_modules_import_root_is_the_directory_it_was_found_in(registry: ToolRegistry) -> None:
    assert import_roots([MODULE, "json"]) == (REPO, os.path.dirname(json.__path__[0]))


def test_only_tools_registered_unsandboxed_are_named(registry: ToolRegistry) -> None:
    assert registry.unsandboxed() == ["worker_pid"]  # not the built-ins ("self")
    assert registry.sandboxed("jail_pid") and not registry.sandboxed("read_file")
    with pytest.raises(ValueError, match="sandbox must be True, False or 'self'"):
        ToolRegistry().tool(sandbox="no")  # type: ignore[arg-type]


def test_a_tool_server_keeps_the_calls_network_and_a_file_server_does_not() -> None:
    box = Confinement(bwrap=BWRAP or "bwrap", network=True, egress="/run/egress.sock")
    hosting = Hosting(modules=(MODULE,), paths=(REPO,))
    tools, files = server_argv(box, "/", hosting), server_argv(box, "/")
    assert "cmdop_worker.machine.toolserve" in tools and "/run/egress.sock" in tools
    assert "cmdop_worker.machine.fileserver" in files and "/run/egress.sock" not in files
    assert tools[tools.index("--tool-modules") + 1] == json.dumps([MODULE])
    assert jail_key(box, "/", hosting) != jail_key(box, "/")


def test_a_tool_user_gets_its_capabilities_before_the_bridge() -> None:
    box = Confinement(bwrap=BWRAP or "bwrap", network=True, egress="/e.sock", user="nobody")
    argv = server_argv(box, "/", Hosting(modules=(MODULE,), paths=(REPO,)))
    end = argv.index("--")
    assert argv[end - 4 : end] == ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    assert "-S" in argv[end + 1 : end + 4]  # the bridge starts the server


@needs_bwrap
def test_replies_and_errors_read_the_same_in_the_sandbox_and_in_process(
    registry: ToolRegistry,
) -> None:
    calls = [
        ("jail_reply", {"output": "slow", "status": "timeout"}),
        ("jail_fail", {}),
        ("jail_pid", {"extra": 1}),
        ("jail_big", {"chars": 50_000}),
    ]
    for tool, args in calls:
        boxed, here = registry.run(tool, args, ctx(jail())), registry.run(tool, args, ctx(None))
        assert (boxed.status, boxed.output) == (here.status, here.output), tool
    assert registry.run("jail_pid", {}, ctx(jail())).output != str(os.getpid())
    assert registry.run("worker_pid", {}, ctx(jail())).output == str(os.getpid())


@needs_bwrap
def test_a_tool_that_kills_its_server_is_not_run_twice(
    registry: ToolRegistry, tmp_path: Path
) -> None:
    tally = tmp_path / "tally"
    outcome = registry.run("jail_exit", {"tally": str(tally)}, ctx(jail(str(tmp_path))))
    assert outcome.status == "error"
    assert outcome.output == "jail_exit failed: its sandboxed tool server died running it"
    assert tally.read_text() == "ran\n"
    assert registry.run("jail_pid", {}, ctx(jail(str(tmp_path)))).status == "ok"


def teardown_module() -> None:
    pool().close()
    filejail._pools.pop(os.getpid(), None)  # the next test's calls get a fresh pool


@needs_bwrap
def test_a_module_the_server_cannot_import_is_a_clear_error(registry: ToolRegistry) -> None:
    host([MODULE, "cmdop_no_such_tools"])  # imported by the worker, say, but not there
    try:
        outcome = registry.run("jail_pid", {}, ctx(jail()))
    finally:
        host([MODULE])
    assert outcome.status == "error"
    assert outcome.output.startswith("jail_pid could not run: the sandboxed tool server did not")
    assert "No module named 'cmdop_no_such_tools'" in outcome.output
    assert registry.run("jail_pid", {}, ctx(jail())).status == "ok"


def test_pythonpath_directories_are_shown_to_the_server() -> None:
    assert python_path({"PYTHONPATH": f"{REPO}:relative::/opt/x"}) == (REPO, "/opt/x")
    assert python_path({}) == ()
