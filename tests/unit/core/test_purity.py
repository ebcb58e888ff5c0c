"""The core stays pure: no I/O libraries, no clock, no randomness, no environment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cmdop_worker.core

CORE = Path(cmdop_worker.core.__file__).parent
FORBIDDEN_MODULES = frozenset(
    {
        "celery",
        "kombu",
        "redis",
        "anthropic",
        "httpx",
        "httpx2",
        "socket",
        "subprocess",
        "os",
        "time",
        "random",
        "threading",
        "asyncio",
        "importlib",
    }
)
FORBIDDEN_CALLS = frozenset({"now", "utcnow", "today"})
CLOCK_OWNERS = frozenset({"datetime", "date"})


def _attribute_chain(node: ast.expr) -> list[str]:
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def impurities(source: str) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            modules = []
        found += [f"import {m}" for m in modules if m.split(".")[0] in FORBIDDEN_MODULES]
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS:
            chain = _attribute_chain(node)
            if CLOCK_OWNERS.intersection(chain[:-1]):
                found.append(".".join(chain))
        if isinstance(node, ast.Name) and node.id == "__import__":
            found.append("__import__")
    return found


MODULES = sorted(CORE.glob("*.py"))


def test_core_has_modules() -> None:
    assert len(MODULES) >= 7


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_module_is_pure(path: Path) -> None:
    assert impurities(path.read_text()) == []


@pytest.mark.parametrize(
    "source",
    [
        "import os",
        "import os.path",
        "from time import monotonic",
        "import celery.app",
        "from anthropic import Anthropic",
        "import redis as r",
        "from random import random",
        "import threading",
        "import datetime\ndatetime.datetime.now()",
        "from datetime import datetime\ndatetime.utcnow()",
        "from datetime import date\ndate.today()",
        "__import__('os')",
    ],
)
def test_checker_catches(source: str) -> None:
    assert impurities(source) != []


@pytest.mark.parametrize(
    "source",
    ["import json", "from dataclasses import dataclass", "import math", "x.now_s = 1"],
)
def test_checker_allows(source: str) -> None:
    assert impurities(source) == []
