"""Settings from the environment, and the example configuration files."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.machine.permissions import Policy

CONFIG = Path(__file__).resolve().parents[2] / "config"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("a.tools, b.more", ["a.tools", "b.more"]),
        ('["x.y"]', ["x.y"]),
        ("", []),
        (" one ", ["one"]),
    ],
)
def test_tool_modules_take_a_json_or_comma_list(monkeypatch, raw, expected) -> None:
    monkeypatch.setenv("CMDOP_TOOL_MODULES", raw)
    assert Settings().tool_modules == expected


@pytest.mark.parametrize(("raw", "expected"), [("none", None), ("0.7", 0.7), ("NONE", None)])
def test_temperature_none_sends_none(monkeypatch, raw, expected) -> None:
    monkeypatch.setenv("CMDOP_TEMPERATURE", raw)
    assert Settings().temperature == expected


def test_aliases_resolve_and_concrete_ids_pass() -> None:
    settings = Settings()
    assert settings.resolve_model("haiku") == "claude-haiku-5-5"
    assert settings.resolve_model("claude-something-new") == "claude-something-new"
    assert settings.resolve_model(None) == settings.resolve_model(settings.model)


def test_the_anthropic_variables_are_read_without_prefix(monkeypatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-secret")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
    settings = Settings()
    assert settings.anthropic_api_key is not None
    assert settings.anthropic_api_key.get_secret_value() == "sk-secret"
    assert "sk-secret" not in repr(settings)
    assert settings.anthropic_base_url == "http://127.0.0.1:9"


def test_example_files_load() -> None:
    settings = Settings(
        agents_file=CONFIG / "agents.example.toml",
        hide_map_file=CONFIG / "hide_map.example.toml",
        policy_file=CONFIG / "policy.example.toml",
    )
    agents = settings.load_agents()
    assert {"operator", "auditor"} <= set(agents)
    assert (
        agents["auditor"].tool_tags == ("fileread",) and agents["auditor"].parallel_tools is False
    )
    assert "execute_command" in settings.load_hide_map()["platform:mobile"]
    raw = settings.load_policy()
    assert raw["mode"] == "default"  # written in the file, not the model's default
    policy = Policy.from_mapping(raw)
    assert policy.mode == "default"
    assert "read_file" in policy.allow and "execute_command(uptime)" in policy.allow
    assert "execute_command(sudo *)" in policy.ask
    assert "execute_command(shutdown*)" in policy.deny


def test_without_files_the_operator_agent_exists() -> None:
    assert list(Settings().load_agents()) == ["operator"]
    assert Settings().load_hide_map() == {}


def test_no_default_model_alias_is_deprecated() -> None:
    from anthropic._data import DEPRECATED_MODELS

    from cmdop_worker.config import DEFAULT_MODEL_ALIASES

    assert not set(DEFAULT_MODEL_ALIASES.values()) & set(DEPRECATED_MODELS)
