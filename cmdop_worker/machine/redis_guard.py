"""Whether a machine worker may start against the Redis it was given.

A tool with network can reach whatever the worker's host reaches. A Redis that answers
without a password is then the whole fleet's control plane in the tool's hands: it
could read every run, cancel runs, and forge calls. So a machine worker whose tools
have network refuses to start against an open Redis, unless the operator says
`CMDOP_ALLOW_OPEN_REDIS=1`; then it starts with one warning, and its presence says so
(`cmdop-worker machines` shows "open redis").

"Open" means the server answers a connection that sends no credentials at all (its
`default` user is `nopass`), whatever the worker's own URL carries: one PING on a fresh
connection at start. When the server cannot be reached then, the URL decides: one
without a password is taken as open.

`open_redis_verdict` decides (pure); `anonymous_access` is the one live check; called
by `lifecycle` when a machine worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import redis

from cmdop_worker.config import masked_url

Verdict = Literal["ok", "warn", "refuse"]
ALLOW_VARIABLE = "CMDOP_ALLOW_OPEN_REDIS"


@dataclass(frozen=True)
class OpenRedis:
    """What start does about the Redis: go on, go on with `message` logged, or stop."""

    verdict: Verdict
    message: str = ""


def url_has_password(url: str) -> bool:
    """A Redis URL that authenticates: `redis://:pw@…` or `redis://user:pw@…`."""
    try:
        return bool(urlsplit(url).password)
    except ValueError:  # a malformed port: the connection itself will say so
        return False


def open_redis_verdict(
    url: str, *, answers_anonymous: bool | None, tools_networked: bool, allow_open: bool
) -> OpenRedis:
    """Refuse an open Redis when tools have network, unless the operator allowed it.
    `answers_anonymous` None: the server could not be asked."""
    is_open = not url_has_password(url) if answers_anonymous is None else answers_anonymous
    if not is_open:
        return OpenRedis("ok")
    why = (
        f"Redis at {masked_url(url)} answers without a password"
        if not url_has_password(url)
        else f"Redis at {masked_url(url)} also answers clients that send no password "
        "(its default user is nopass)"
    )
    if not tools_networked:
        return OpenRedis("ok")
    if allow_open:
        return OpenRedis(
            "warn",
            f"{why}, and this machine's tools have network: a tool can reach the fleet's "
            f"control plane ({ALLOW_VARIABLE}=1 allows it)",
        )
    return OpenRedis(
        "refuse",
        f"{why}, and this machine's tools have network, so a tool could read, cancel and "
        "approve runs. Give Redis a password (requirepass, or an ACL user: `cmdop-worker "
        "acl`) and put it in CMDOP_REDIS_URL (redis://USER:PASSWORD@host:port/db); or "
        'set [sandbox] network = "none" in the policy; or set '
        f"{ALLOW_VARIABLE}=1 to run anyway",
    )


def anonymous_access(url: str) -> bool | None:
    """Whether the server behind `url` answers a client that sends no credentials;
    None when it cannot be reached now."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    except ValueError:  # a scheme redis-py cannot open alone (sentinel://): the URL decides
        return None
    kwargs = client.connection_pool.connection_kwargs
    kwargs.pop("username", None)
    kwargs.pop("password", None)
    try:
        client.ping()
    except redis.AuthenticationError:
        return False
    except redis.ResponseError as exc:  # NOAUTH on older servers
        return "NOAUTH" not in str(exc)
    except (redis.ConnectionError, redis.TimeoutError):
        return None
    finally:
        client.close()
    return True
