"""The fleet's unix sockets: read from its URLs, hidden from tools, spelled for Celery."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from cmdop_worker.celery_app import celery_url
from cmdop_worker.machine.egress import proxy_sockets
from cmdop_worker.machine.floor_mounts import socket_mount
from cmdop_worker.machine.netpolicy import fleet_sockets


def test_fleet_sockets_are_read_from_every_socket_scheme() -> None:
    urls = [
        "unix:///srv/redis/redis.sock?db=0",
        "redis+socket:///srv/redis/redis.sock",
        "redis://:pw@127.0.0.1:6379/0",
        "REDIS-SOCKET:///var/lib/r%20s/redis.sock",
        "unix://user:pw@/opt/r.sock",
        "sentinel://h1:26379;sentinel://h2:26379",
        "unix://relative.sock",
    ]
    assert fleet_sockets(urls) == [
        "/srv/redis/redis.sock",
        "/var/lib/r s/redis.sock",
        "/opt/r.sock",
    ]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["/home/op/project"], ("/srv/redis", ["--perms", "0000", "--tmpfs", "/srv/redis"])),
        (
            ["/srv/redis"],
            ("/srv/redis/redis.sock", ["--ro-bind", "BLANK", "/srv/redis/redis.sock"]),
        ),
        (["/srv"], ("/srv/redis", ["--perms", "0000", "--tmpfs", "/srv/redis"])),  # in a grant
        (
            ["/srv/redis/data"],
            ("/srv/redis/redis.sock", ["--ro-bind", "BLANK", "/srv/redis/redis.sock"]),
        ),
    ],
)
def test_a_socket_hides_its_directory_unless_the_call_was_given_it(
    given: list[str], expected: tuple[str, list[str]]
) -> None:
    target, args = socket_mount("/srv/redis/redis.sock", given, "BLANK")
    assert target == expected[0]
    assert args[: len(expected[1])] == expected[1]


def test_a_socket_in_a_top_level_directory_is_hidden_alone() -> None:
    assert socket_mount("/srv/redis.sock", ["/work"], "BLANK") == (
        "/srv/redis.sock",
        ["--ro-bind", "BLANK", "/srv/redis.sock"],
    )


def test_celery_reads_a_unix_url_as_redis_socket() -> None:
    assert celery_url("unix:///srv/redis/redis.sock") == "redis+socket:///srv/redis/redis.sock"
    assert celery_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_the_other_egress_proxies_are_found_and_the_own_one_left_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sockets = []
    for name in ("cmdop-egress-a", "cmdop-egress-b", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "egress.sock").touch()
        sockets.append(str(tmp_path / name / "egress.sock"))
    assert proxy_sockets(own=sockets[0]) == [sockets[1]]
    assert sorted(proxy_sockets(own=None)) == sockets[:2]
