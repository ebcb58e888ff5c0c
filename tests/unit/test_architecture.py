"""The file list is the architecture: wings, one-way imports, no circles, small modules.

`lint-imports` (run in CI) checks which wing may import which; this checks what a
contract cannot say: that no module imports another that imports it back, directly
or through others, that the package top stays a handful of shared modules, and that
no module grows past the size a reader can hold.
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

import cmdop_worker

PACKAGE = Path(cmdop_worker.__file__).parent
MAX_TOP_MODULES = 13
MAX_MODULE_LINES = 400
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
