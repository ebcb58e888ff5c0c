"""The file list is the architecture: wings, one-way imports, no circles, small modules.

`lint-imports` (run in CI) checks which wing may import which; this checks what a
contract cannot say: that no module imports another that imports it back, directly
or through others, that the package top stays a handful of shared modules, that no
module grows past the size a reader can hold, and that only `messages` sends a task
(a contract sees who imports Celery, not who calls an app it was handed).
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

import cmdop_worker

PACKAGE = Path(cmdop_worker.__file__).parent
MAX_TOP_MODULES = 13
MAX_MODULE_LINES = 400
# Celery's ways to put a task on the broker: on an app, a task or a signature.
SENDING_CALLS = frozenset({"send_task", "apply_async", "delay"})
WINGS = ("core", "state", "llm", "coordinator", "machine", "surfaces", "testing")


def import_cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Each import A -> B for which B leads back to A, as the circle A -> B -> ... -> A."""
    circles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                circles.append((importer, *back))
    return circles


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("cmdop_worker")


def test_no_module_imports_another_that_imports_it_back(graph: grimp.ImportGraph) -> None:
    assert import_cycles(graph) == []


def test_cycle_finder_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z", "a.w"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.z")
    graph.add_import(importer="a.z", imported="a.x")
    graph.add_import(importer="a.w", imported="a.x")
    assert import_cycles(graph) == [
        ("a.x", "a.y", "a.z", "a.x"),
        ("a.y", "a.z", "a.x", "a.y"),
        ("a.z", "a.x", "a.y", "a.z"),
    ]


def test_the_top_holds_only_the_shared_modules() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


@pytest.mark.parametrize("wing", WINGS)
def test_each_wing_says_what_it_owns(wing: str) -> None:
    init = PACKAGE / wing / "__init__.py"
    assert init.exists()
    assert init.read_text().lstrip().startswith('"""'), f"{wing}/__init__.py has no docstring"


def test_no_module_is_longer_than_a_reader_can_hold() -> None:
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def sending_calls(source: str) -> list[str]:
    """`<line>: <name>` for each call of Celery's sending methods in `source`."""
    return [
        f"{node.lineno}: {node.func.attr}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in SENDING_CALLS
    ]


def test_only_the_messages_module_sends_tasks() -> None:
    senders = {
        str(path.relative_to(PACKAGE)): calls
        for path in PACKAGE.rglob("*.py")
        if path.name != "messages.py" and (calls := sending_calls(path.read_text()))
    }
    assert senders == {}


def test_the_sending_finder_finds_each_way_to_send() -> None:
    source = "app.send_task('x')\nrun.apply_async(args=[1])\nrun.s(1).delay()\nsend_task('y')\n"
    assert sending_calls(source) == ["1: send_task", "2: apply_async", "3: delay"]
