"""Whether a machine worker starts against the Redis it was given (`redis_guard`)."""

from __future__ import annotations

import pytest

from cmdop_worker.machine.redis_guard import open_redis_verdict, url_has_password

OPEN = "redis://127.0.0.1:6379/0"
WITH_PASSWORD = "redis://:s3cret@127.0.0.1:6379/0"
ACL_USER = "redis://machine-web:s3cret@redis:6379/0"


@pytest.mark.parametrize(
    ("url", "has"),
    [
        (OPEN, False),
        (WITH_PASSWORD, True),
        (ACL_USER, True),
        ("redis://user@host:6379/0", False),
        ("rediss://:pw@host:6380/0?ssl_cert_reqs=required", True),
        ("unix:///run/redis.sock", False),
        ("redis://host:notaport/0", False),
    ],
)
def test_a_url_authenticates_only_with_a_password(url: str, has: bool) -> None:
    assert url_has_password(url) is has


@pytest.mark.parametrize(
    ("url", "anonymous", "networked", "allow", "verdict"),
    [
        (OPEN, True, True, False, "refuse"),
        (OPEN, True, True, True, "warn"),
        (OPEN, True, False, False, "ok"),  # tools without network cannot reach it
        (WITH_PASSWORD, False, True, False, "ok"),
        (ACL_USER, True, True, False, "refuse"),  # its default user is nopass
        (OPEN, None, True, False, "refuse"),  # not reachable now: the URL decides
        (WITH_PASSWORD, None, True, False, "ok"),
        (OPEN, False, True, False, "ok"),  # it takes none from us but needs one
    ],
)
def test_an_open_redis_is_refused_when_tools_have_network_unless_allowed(
    url: str, anonymous: bool | None, networked: bool, allow: bool, verdict: str
) -> None:
    decided = open_redis_verdict(
        url, answers_anonymous=anonymous, tools_networked=networked, allow_open=allow
    )
    assert decided.verdict == verdict


def test_the_refusal_names_every_way_out_and_never_the_password() -> None:
    decided = open_redis_verdict(
        "redis://machine:hunter2@h:1/0",
        answers_anonymous=True,
        tools_networked=True,
        allow_open=False,
    )
    assert "hunter2" not in decided.message and "redis://machine:***@h:1/0" in decided.message
    for way_out in (
        "requirepass",
        "cmdop-worker acl",
        'network = "none"',
        "CMDOP_ALLOW_OPEN_REDIS=1",
    ):
        assert way_out in decided.message


def test_a_server_that_cannot_be_asked_leaves_the_url_to_decide() -> None:
    from cmdop_worker.machine.redis_guard import anonymous_access
    from cmdop_worker.surfaces.fleet import free_port

    assert anonymous_access(f"redis://127.0.0.1:{free_port()}/0") is None
    assert anonymous_access("sentinel://127.0.0.1:26379") is None
