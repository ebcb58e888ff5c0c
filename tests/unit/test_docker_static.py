"""docker/: checked without a Docker engine (none runs here): the compose file and the
Dockerfile refer only to things that exist and configure only settings that exist."""

from __future__ import annotations

import json
import shlex
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import yaml

from cmdop_worker.config import Settings
from cmdop_worker.logs import LogSettings
from cmdop_worker.surfaces.cli import build_parser
from tests.conftest import repo_root

DOCKER = repo_root() / "docker"
CONSOLE_SCRIPTS = {ep.name for ep in entry_points(group="console_scripts")}
# Programs the image has besides console scripts, and the Redis image's own.
IMAGE_PROGRAMS = CONSOLE_SCRIPTS | {"python"}
REDIS_PROGRAMS = {"redis-server", "redis-cli"}


def env_names(settings: type[Any]) -> set[str]:
    names = set()
    for name, field in settings.model_fields.items():
        alias = field.validation_alias
        choices = getattr(alias, "choices", [alias] if isinstance(alias, str) else [])
        names.update(str(choice) for choice in choices)
        if not choices:
            names.add(f"CMDOP_{name.upper()}")
    return names


KNOWN_ENV = env_names(Settings) | env_names(LogSettings)


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return dict(compose["services"])


def dockerfile_lines() -> list[str]:
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def dockerfile_instruction(name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in dockerfile_lines() if line.split()[0] == name]


def test_the_fleet_is_redis_a_coordinator_two_machines_flower_and_the_gateway(services) -> None:
    assert set(services) == {"redis", "coordinator", "alpha", "beta", "flower", "gateway"}


def test_every_command_is_a_program_the_image_has(services) -> None:
    default_entrypoint = json.loads(dockerfile_instruction("ENTRYPOINT")[0])
    for name, service in services.items():
        if "build" not in service:
            assert service["image"].startswith("redis:")
            assert service["command"][0] in REDIS_PROGRAMS
            continue
        argv = [*service.get("entrypoint", default_entrypoint), *service.get("command", [])]
        assert argv[0] in CONSOLE_SCRIPTS, f"{name}: {argv[0]} is not an installed program"
        if argv[0] == "cmdop-worker":
            build_parser().parse_args(argv[1:])  # exits (fails the test) when it does not parse


def test_every_cmdop_variable_is_a_real_setting(services) -> None:
    for name, service in services.items():
        for variable in service.get("environment", {}):
            if variable.startswith("CMDOP_"):
                assert variable in KNOWN_ENV, f"{name}: {variable} is not a setting"


def test_every_service_has_a_healthcheck_with_a_real_program(services) -> None:
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL"), name
        program = test[1] if test[0] == "CMD" else shlex.split(test[1])[0]
        known = IMAGE_PROGRAMS if "build" in service else REDIS_PROGRAMS
        assert program in known, f"{name}: healthcheck runs {program}"


def test_machine_healthchecks_check_their_own_presence(services) -> None:
    # Not `celery inspect`: a machine under its own Redis user takes no remote control.
    for machine in ("alpha", "beta"):
        check = services[machine]["healthcheck"]["test"][1]
        assert check.startswith("cmdop-worker machines --json | python -c ")
        assert f"m['machine'] == '{machine}'" in check
        assert "m['host'] == os.environ['HOSTNAME']" in check
        assert "inspect" not in check


def test_redis_needs_a_password_and_is_not_published(services) -> None:
    redis = services["redis"]
    assert "ports" not in redis
    assert "--requirepass" in redis["command"]
    for service in services.values():
        url = service.get("environment", {}).get("CMDOP_REDIS_URL")
        if url is not None:
            assert url.startswith("redis://:${REDIS_PASSWORD")


def test_flower_has_basic_auth_and_listens_on_loopback_only(services) -> None:
    flower = services["flower"]
    auth = flower["environment"].get("FLOWER_BASIC_AUTH", "")
    assert "${FLOWER_USER:?" in auth and "${FLOWER_PASSWORD:?" in auth
    assert all(str(port).startswith("127.0.0.1:") for port in flower["ports"])
    assert "/healthcheck" in " ".join(flower["healthcheck"]["test"])


def test_flower_shares_no_network_with_a_worker(services) -> None:
    """Flower's /metrics is open (Flower 2.2 has no auth for it) and machine workers run
    model-chosen commands: only Redis is on Flower's network."""
    flower = set(services["flower"]["networks"])
    for name, service in services.items():
        if name not in ("flower", "redis"):
            assert not flower & set(service["networks"]), f"{name} can reach Flower"
    assert flower <= set(services["redis"]["networks"])


def test_the_dockerfile_copies_what_exists_and_runs_as_a_user() -> None:
    assert dockerfile_instruction("FROM") == ["python:3.11-slim"]
    for copy in dockerfile_instruction("COPY"):
        *sources, _destination = shlex.split(copy)
        for source in sources:
            assert (repo_root() / source).exists(), f"COPY {source}: no such file"
    lines = dockerfile_lines()
    user = next(i for i, line in enumerate(lines) if line.startswith("USER "))
    entry = next(i for i, line in enumerate(lines) if line.startswith("ENTRYPOINT "))
    assert user < entry and lines[user].split()[1] not in ("root", "0")
    assert json.loads(dockerfile_instruction("ENTRYPOINT")[0]) == ["cmdop-worker"]
    assert any("pip install ." in run for run in dockerfile_instruction("RUN"))


def test_build_context_is_the_repository_root(services) -> None:
    for service in services.values():
        if "build" in service:
            context = (DOCKER / service["build"]["context"]).resolve()
            assert context == repo_root().resolve()
            assert (context / service["build"]["dockerfile"]) == Path(DOCKER / "Dockerfile")


def test_the_gateway_needs_tokens_and_is_published_on_loopback_only(services) -> None:
    """It listens on 0.0.0.0 inside its container, which it refuses to do without
    tokens; compose refuses to start without them, and publishes it on loopback."""
    gateway = services["gateway"]
    assert gateway["command"][:3] == ["gateway", "--host", "0.0.0.0"]
    assert gateway["environment"]["CMDOP_GATEWAY_TOKENS"].startswith("${CMDOP_GATEWAY_TOKENS:?")
    # Bound to 0.0.0.0, it starts only knowing the names it answers to (DNS rebinding).
    assert gateway["environment"]["CMDOP_GATEWAY_ALLOWED_HOSTS"].startswith(
        "${CMDOP_GATEWAY_ALLOWED_HOSTS:-localhost,127.0.0.1"
    )
    assert all(str(port).startswith("127.0.0.1:") for port in gateway["ports"])
    assert "/healthz" in " ".join(gateway["healthcheck"]["test"])
