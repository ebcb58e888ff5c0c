"""Settings from the environment, and the example configuration files."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmdop_worker.config import GOT_MAX_CHARS, ConfigFileError, Settings, masked_url
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


@pytest.mark.parametrize(
    ("field", "text", "said"),
    [
        (
            "agents_file",
            "[agents.ops]\nsystem_prompt = 'x'\nmax_turns = 'many'\n",
            ":3: agents.ops.max_turns: Input should be a valid integer",
        ),
        (
            "agents_file",
            "[agents.ops]\nmodle = 'haiku'\n",
            ":2: agents.ops.modle: Extra inputs are not permitted",
        ),
        ("agents_file", "[agents\n", ": not valid TOML: "),
        ("hide_map_file", "[hide]\n'*' = 'bash'\n", ":2: hide.*: not a list of tool names"),
    ],
)
def test_a_bad_configuration_file_is_one_line_naming_file_line_and_problem(
    tmp_path: Path, field: str, text: str, said: str
) -> None:
    path = tmp_path / "file.toml"
    path.write_text(text)
    settings = Settings(**{field: path})
    with pytest.raises(ConfigFileError) as caught:
        settings.load_agents() if field == "agents_file" else settings.load_hide_map()
    message = str(caught.value)
    assert message.startswith(f"{path}{said}"), message
    assert "\n" not in message


def test_a_configured_file_that_does_not_exist_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigFileError, match=f"^{missing}: no such file$"):
        Settings(policy_file=missing).load_policy()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # the password runs to the LAST '@' of the authority, as redis-py reads it
        ("redis://u:TOP@SECRET2@127.0.0.1:1/0", "redis://u:***@127.0.0.1:1/0"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://user:p:w@h/1", "rediss://user:***@h/1"),
        ("redis://127.0.0.1:6379/0?password=QSECRET4", "redis://127.0.0.1:6379/0?password=***"),
        (
            "rediss://h/0?ssl_cert_reqs=none&sentinel_password=S1&db=1",
            "rediss://h/0?ssl_cert_reqs=none&sentinel_password=***&db=1",
        ),
        ("redis://h/0?PASSWORD=S2#frag", "redis://h/0?PASSWORD=***#frag"),
        ("unix://:pw@/tmp/redis.sock?db=0", "unix://:***@/tmp/redis.sock?db=0"),
        ("unix:///tmp/redis.sock?password=S3", "unix:///tmp/redis.sock?password=***"),
        (
            "sentinel://:a@b@h1:26379;sentinel://:c@h2:26379/0",
            "sentinel://:***@h1:26379;sentinel://:***@h2:26379/0",
        ),
        ("amqp://guest:gu@st@rabbit:5672//", "amqp://guest:***@rabbit:5672//"),
        # a URL urllib cannot read (its port is no number) shows no more than its scheme
        ("redis://u:ab/cd@host", "redis://***"),
        ("redis://u:ab#cd@h/0", "redis://***"),
        ("redis://:pw@[::1:6379/0", "redis://***"),
        # nothing secret: as it is
        ("redis://h:99999/0", "redis://h:99999/0"),
        ("redis://h:port/0", "redis://h:port/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://user@h/0", "redis://user@h/0"),
        ("redis://[::1]:6379/0?db=2", "redis://[::1]:6379/0?db=2"),
        ("no url here", "no url here"),
        # URLs inside a line of text
        ("at redis://u:p@w@h, then amqp://x:y@z", "at redis://u:***@h, then amqp://x:***@z"),
        ("(got 'redis://:ENVSECRET8b@h')", "(got 'redis://:***@h')"),
    ],
)
def test_masked_url_hides_every_password(url: str, shown: str) -> None:
    assert masked_url(url) == shown


def test_a_wrong_value_in_a_config_file_is_shown_masked_and_cut(tmp_path: Path) -> None:
    agents = tmp_path / "agents.toml"
    agents.write_text(
        '[agents.operator]\nsystem_prompt = "x"\nmax_turns = "redis://:ENVSECRET8b@h"\n'
    )
    with pytest.raises(ConfigFileError) as refused:
        Settings(agents_file=agents).load_agents()
    said = str(refused.value)
    assert "max_turns" in said
    assert "ENVSECRET8b" not in said
    assert "(got 'redis://:***@h')" in said

    agents.write_text(f'[agents.operator]\nmax_turns = "{"x" * 500}"\n')
    with pytest.raises(ConfigFileError) as refused:
        Settings(agents_file=agents).load_agents()
    got = str(refused.value).partition("(got ")[2]
    assert got.endswith("…)")
    assert len(got) <= GOT_MAX_CHARS + 1
