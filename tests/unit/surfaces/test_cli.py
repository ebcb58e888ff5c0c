"""The command line's own options (the commands are driven end to end in tests/e2e)."""

from __future__ import annotations

import tomllib

import pytest

from cmdop_worker import __version__
from cmdop_worker.surfaces.cli import main
from tests.conftest import repo_root


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"cmdop-worker {__version__}\n"


def test_the_package_version_is_the_distributions() -> None:
    """The wheel is versioned by pyproject.toml; `--version` reads the package's."""
    project = tomllib.loads((repo_root() / "pyproject.toml").read_text())["project"]
    assert __version__ == project["version"]
