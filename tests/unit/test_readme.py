"""The README's settings table names every setting there is."""

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
