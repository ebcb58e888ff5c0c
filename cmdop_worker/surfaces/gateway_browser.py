"""The gateway against the browser: what a web page can make a browser send it.

Any page a person has open can send requests to the gateway's address, and a page whose
name was made to resolve to that address (DNS rebinding) can even read the answers.
Pure decisions, table-tested (`tests/unit/surfaces/test_gateway_browser.py`), enforced by
`gateway_guard` and attacked from chromium in `tests/e2e/test_gateway_browser.py`:

- `host_rules` / `host_allowed`: the `Host` names the gateway answers to — its bound
  address (with `localhost`, `127.0.0.1` and `[::1]` when that is loopback or a wildcard)
  and `CMDOP_GATEWAY_ALLOWED_HOSTS`. A rebound page sends its own name: refused on every
  path. A rule without a port takes any port (a proxy in front); one with a port, that
  port. A browser always names the port it connects to; a Host without one (a client
  that is not a browser) is matched by name.
- `hosts_refusal`: why the gateway must not start with these rules — a wildcard address
  naming no host, or `*` on a gateway with no token (that is rebinding let back in).
- `content_type_refusal`: a POST's body is `application/json` (UTF-8). A form or a
  no-cors fetch can send only `text/plain`, urlencoded or multipart.
- `client_header_refusal`: a gateway without tokens takes writes only with the header
  `X-Cmdop-Client`. A page on another origin cannot add a header without a preflight,
  and the gateway grants none (unless `CMDOP_GATEWAY_CORS_ORIGINS` names that origin).
- `site_refusal`: a browser names where a request comes from (`Sec-Fetch-Site`); one
  from another site, or another port of this one, is refused unless its `Origin` is a
  CORS origin. Clients that are not browsers send no such header.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from cmdop_worker.surfaces.gateway_auth import READ_METHODS, is_loopback

CLIENT_HEADER = "x-cmdop-client"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", "[::]", ""})
_NAME = re.compile(r"(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?\.?|\*")
_PORT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True)
class HostRule:
    name: str  # lower case; `[v6]` bracketed; `*` any; `*.example.com` its subdomains
    port: int | None = None  # None: any port

    def admits(self, name: str, port: int | None) -> bool:
        if self.port is not None and port is not None and self.port != port:
            return False
        if self.name == "*":
            return True
        if self.name.startswith("*."):
            return name.endswith(self.name[1:])
        return name.rstrip(".") == self.name.rstrip(".")


def split_host(value: str) -> tuple[str, int | None] | None:
    """`name[:port]` of a Host header or a rule, lower-cased; None when malformed."""
    text = value.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        name, rest = text[: end + 1], text[end + 1 :]
        if end < 0 or not _is_ip(name[1:-1], 6):
            return None
    elif text.count(":") > 1 and _is_ip(text, 6):
        name, rest = f"[{text}]", ""  # a bare IPv6 address (rules only: a Host has brackets)
    else:
        name, colon, port = text.partition(":")
        rest = colon + port
        if not _NAME.fullmatch(name):
            return None
    if not rest:
        return name, None
    if rest[0] != ":" or not _PORT.fullmatch(rest[1:]) or int(rest[1:]) > 65535:
        return None
    return name, int(rest[1:])


def _is_ip(text: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(text).version == version
    except ValueError:
        return False


def parse_rules(entries: list[str]) -> list[HostRule]:
    """The rules of `CMDOP_GATEWAY_ALLOWED_HOSTS`; ValueError naming a malformed one."""
    rules = []
    for entry in entries:
        parsed = split_host(entry)
        if parsed is None:
            raise ValueError(
                f"CMDOP_GATEWAY_ALLOWED_HOSTS: '{entry[:80]}' is not a host name, "
                "address or *.domain, with an optional :port"
            )
        rules.append(HostRule(*parsed))
    return rules


def host_rules(bind_host: str, port: int, allowed: list[HostRule]) -> list[HostRule]:
    """Every Host the gateway answers to when it listens on `bind_host:port`."""
    bound = bind_host.strip().lower()
    any_port = None if port == 0 else port  # port 0: the system picks; no name pins one
    rules = list(allowed)
    if bound in WILDCARD_BINDS or is_loopback(bound):
        rules += [HostRule(name, any_port) for name in LOOPBACK_NAMES]
    if bound not in WILDCARD_BINDS:
        parsed = split_host(bound)
        if parsed is not None:
            rules.append(HostRule(parsed[0], any_port))
    return rules


def hosts_refusal(bind_host: str, allowed: list[HostRule], tokens_configured: bool) -> str | None:
    """Why the gateway must not start with these allowed hosts, or None."""
    if not tokens_configured and any(rule.name == "*" for rule in allowed):
        return (
            "CMDOP_GATEWAY_ALLOWED_HOSTS=* with no token configured: a web page whose name "
            "resolves to this address could drive the gateway. Name the hosts, or set "
            "CMDOP_GATEWAY_TOKENS"
        )
    if bind_host.strip().lower() in WILDCARD_BINDS and not allowed:
        return (
            f"listening on {bind_host or 'every address'}, the gateway cannot tell which "
            "names it is reached by: set CMDOP_GATEWAY_ALLOWED_HOSTS to them "
            "(comma-separated, e.g. gw.example.com,10.0.0.5:8080; * for any)"
        )
    return None


def host_allowed(header: str | None, rules: list[HostRule]) -> bool:
    """Whether a request with this Host header is for this gateway."""
    parsed = split_host(header) if header else None
    if parsed is None or parsed[0] == "*" or parsed[0].startswith("*."):
        return False
    name, port = parsed
    return any(rule.admits(name, port) for rule in rules)


def content_type_refusal(header: str | None) -> str | None:
    """Why a POST with this Content-Type is refused (415), or None."""
    if header is None or not header.strip():
        return "a POST needs Content-Type: application/json"
    media, _, params = header.partition(";")
    if media.strip().lower() != "application/json":
        return f"Content-Type '{header[:80]}' is not application/json"
    for param in params.split(";"):
        name, _, value = param.partition("=")
        charset = value.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            return f"charset '{charset[:40]}': the body must be UTF-8"
    return None


def client_header_refusal(tokens_configured: bool, method: str, value: str | None) -> str | None:
    """Why a request is refused (403) for want of `X-Cmdop-Client`, or None."""
    if tokens_configured or method.upper() in READ_METHODS or (value or "").strip():
        return None
    return (
        "this gateway has no tokens, so a write needs the header X-Cmdop-Client "
        "(any value): a web page on another origin cannot send it"
    )


def site_refusal(fetch_site: str | None, origin: str | None, cors: list[str]) -> str | None:
    """Why a browser's request from another site is refused (403), or None."""
    if fetch_site is None or fetch_site.strip().lower() in ("same-origin", "none"):
        return None
    if "*" in cors or (origin is not None and origin in cors):
        return None
    return (
        f"a request from a page on another origin ({(origin or 'unknown')[:100]}) is refused; "
        "CMDOP_GATEWAY_CORS_ORIGINS names the origins whose pages may call the gateway"
    )
