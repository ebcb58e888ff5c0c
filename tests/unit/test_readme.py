"""The README's settings table names every setting there is; its and the docs' links resolve."""

from __future__ import annotations

import re
from pathlib import Path

from cmdop_worker.config import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_documented() -> None:
    documented = set(re.findall(r"`(CMDOP_[A-Z0-9_]+|ANTHROPIC_[A-Z_]+)`", README))
    names = {f"CMDOP_{name.upper()}" for name in Settings.model_fields} - {
        "CMDOP_ANTHROPIC_API_KEY",
        "CMDOP_ANTHROPIC_BASE_URL",
        "CMDOP_OTLP_ENDPOINT",  # read as OTEL_EXPORTER_OTLP_ENDPOINT
    }
    missing = sorted(names - documented)
    assert not missing, f"settings missing from the README table: {missing}"


def test_every_relative_link_resolves_inside_the_repository() -> None:
    root = Path(__file__).resolve().parents[2]
    links = re.findall(r"\]\(([^)#\s]+)\)", README)
    local = [link for link in links if "://" not in link]
    assert local, "the README links no files"
    broken = [
        link
        for link in local
        if not (root / link).exists() or not (root / link).resolve().is_relative_to(root)
    ]
    assert not broken, f"README links that a clone does not have: {broken}"


def broken_links(page: Path, root: Path) -> list[str]:
    """The relative links of a Markdown page that name no file of the repository."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", page.read_text())
    local = [link for link in links if "://" not in link]
    return [
        link
        for link in local
        if not (page.parent / link).exists()
        or not (page.parent / link).resolve().is_relative_to(root)
    ]


def test_every_relative_link_in_the_docs_resolves() -> None:
    root = Path(__file__).resolve().parents[2]
    pages = sorted((root / "docs").glob("*.md"))
    assert pages, "no docs found"
    broken = {page.name: links for page in pages if (links := broken_links(page, root))}
    assert broken == {}


def test_the_link_finder_finds_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("")
    page.write_text("[ok](there.md) [web](https://example.com/x.md) [gone](missing.md#part)")
    assert broken_links(page, tmp_path) == ["missing.md"]
