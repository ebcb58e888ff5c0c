"""File tools see canonical paths: `..`, `//`, `~`, relative paths and symlinks are
resolved before a rule or the floor looks, and `write_file` never writes through a
link. Attacked through a real machine worker in mode strict (no rule: denied), whose
rules grant one tree: `<base>/allowed`, which its sandbox also makes writable (file
tools run in the sandbox: a rule alone does not make a read-only path writable).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import PolicyBase, run_tool_calls
from .conftest import stop_machines

pytestmark = pytest.mark.integration

SECRET = "paths-secret-5e1c0a"


@dataclass
class Tree:
    client: Client
    fake: FakeAnthropic
    base: Path  # holds secret.txt, outside the granted tree
    allowed: Path  # the granted tree; the worker's working directory
    outside: Path  # a directory nothing grants

    def call(self, tool: str, **tool_input: Any) -> Event:
        uses = [{"name": tool, "input": tool_input}]
        (end,) = run_tool_calls(self.client, self.fake, "files", uses)
        return end


@pytest.fixture(scope="module")
def tree(
    plain_base: PolicyBase, fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tree]:
    base = tmp_path_factory.mktemp("paths")
    allowed, outside = base / "allowed", base / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (base / "secret.txt").write_text(SECRET)
    (allowed / "ok.txt").write_text("fine\n")
    (allowed / "up").symlink_to(base)  # a link to a parent directory
    (allowed / "etc").symlink_to("/etc")
    (allowed / "outdir").symlink_to(outside)
    (allowed / "secret-link.txt").symlink_to(base / "secret.txt")
    (allowed / "inside-link.txt").symlink_to(allowed / "ok.txt")
    grant = f"{allowed}/*"
    policy = base / "policy.toml"
    policy.write_text(
        'mode = "strict"\n[rules]\nallow = ['
        + ", ".join(
            f'"{tool}({grant})"' for tool in ("read_file", "write_file", "list_dir", "grep", "glob")
        )
        + "]\n"
        + f'[sandbox]\nwritable = ["{allowed}"]\n'
    )
    fleet = plain_base.fleet
    cwd = os.getcwd()
    try:
        os.chdir(allowed)  # the machine worker's working directory: relative paths start here
        try:
            fleet.start_machine("files", {"CMDOP_POLICY_FILE": str(policy), "HOME": str(base)})
        finally:
            os.chdir(cwd)
        fleet.wait_ready(["files"], timeout_s=60)
        with Client(Settings(redis_url=plain_base.server.url)) as client:
            yield Tree(client, fake_model, base, allowed, outside)
    finally:
        stop_machines(plain_base, ["files"])


@pytest.mark.parametrize(
    "path",
    [
        "{allowed}/../secret.txt",
        "{allowed}/sub/../../secret.txt",
        "{allowed}//..//secret.txt",
        "../secret.txt",
        "sub/../../secret.txt",
        "~/secret.txt",
        "{allowed}/up/secret.txt",
        "{allowed}/secret-link.txt",
        "secret-link.txt",
        "{allowed}/etc/hostname",
    ],
)
def test_reads_outside_the_granted_tree_are_denied(tree: Tree, path: str) -> None:
    end = tree.call("read_file", path=path.format(allowed=tree.allowed))
    assert end.data["status"] == "denied", end.data
    assert SECRET not in end.data["output"]


@pytest.mark.parametrize("path", ["{allowed}/ok.txt", "ok.txt", "sub/../ok.txt", "inside-link.txt"])
def test_reads_inside_the_tree_work_however_they_are_spelled(tree: Tree, path: str) -> None:
    end = tree.call("read_file", path=path.format(allowed=tree.allowed))
    assert end.data["status"] == "ok", end.data
    assert "fine" in end.data["output"]


def test_write_file_refuses_a_symlink_as_its_final_component(tree: Tree) -> None:
    link = tree.allowed / "trap.txt"
    target = tree.outside / f"victim-{uuid.uuid4().hex[:6]}"
    link.symlink_to(target)
    end = tree.call("write_file", path=str(link), content="owned")
    assert end.data["status"] == "denied", end.data
    assert "symlink" in end.data["output"]
    assert not target.exists()


@pytest.mark.parametrize("path", ["{allowed}/outdir/new.txt", "{allowed}/up/outside/new.txt"])
def test_write_file_through_a_linked_directory_is_denied(tree: Tree, path: str) -> None:
    end = tree.call("write_file", path=path.format(allowed=tree.allowed), content="owned")
    assert end.data["status"] == "denied", end.data
    assert not (tree.outside / "new.txt").exists()


def test_write_file_inside_the_tree_works(tree: Tree) -> None:
    name = f"made-{uuid.uuid4().hex[:6]}.txt"
    end = tree.call("write_file", path=f"sub/{name}", content="hello")
    assert end.data["status"] == "ok", end.data
    assert (tree.allowed / "sub" / name).read_text() == "hello"


@pytest.mark.parametrize(
    ("tool", "tool_input"),
    [
        ("grep", {"pattern": SECRET[:6], "path": "{base}"}),
        ("grep", {"pattern": SECRET[:6], "path": "{allowed}/up"}),
        ("grep", {"pattern": SECRET[:6], "path": ".."}),
        ("glob", {"pattern": "*.txt", "path": "{base}"}),
        ("glob", {"pattern": "../*.txt"}),
        ("glob", {"pattern": "{base}/*.txt"}),
        ("glob", {"pattern": "up/*.txt"}),
        ("list_dir", {"path": "{allowed}/up"}),
        ("list_dir", {"path": ".."}),
    ],
)
def test_search_roots_outside_the_tree_are_denied(
    tree: Tree, tool: str, tool_input: dict[str, str]
) -> None:
    spelled = {k: v.format(base=tree.base, allowed=tree.allowed) for k, v in tool_input.items()}
    end = tree.call(tool, **spelled)
    assert end.data["status"] == "denied", end.data
    assert SECRET not in end.data["output"] and "secret.txt" not in end.data["output"]


def test_search_inside_the_tree_works(tree: Tree) -> None:
    grep = tree.call("grep", pattern="fine", path=".")
    glob = tree.call("glob", pattern="*.txt")
    assert grep.data["status"] == "ok" and "ok.txt" in grep.data["output"], grep.data
    assert glob.data["status"] == "ok" and "ok.txt" in glob.data["output"], glob.data


def test_grep_does_not_follow_a_link_out_of_its_tree(tree: Tree) -> None:
    end = tree.call("grep", pattern=SECRET[:6], path=".")
    assert end.data["status"] == "ok", end.data
    assert SECRET not in end.data["output"]


@pytest.mark.parametrize("tool", ["read_file", "write_file", "list_dir"])
def test_a_path_that_is_no_path_is_an_invalid_call_not_a_lost_one(tree: Tree, tool: str) -> None:
    tool_input: dict[str, Any] = {"path": "a\u0000b"}
    if tool == "write_file":
        tool_input["content"] = "x"
    end = tree.call(tool, **tool_input)
    assert end.data["status"] in ("invalid", "error"), end.data  # answered, not lost
    assert "null" in end.data["output"]
