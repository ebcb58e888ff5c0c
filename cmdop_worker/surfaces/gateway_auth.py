"""The gateway's trust boundary: who may call it, from where, how often, how much.

Pure decisions, table-tested (`tests/unit/surfaces/test_gateway_auth.py`) and enforced by
`gateway_guard` in front of every route:

- `parse_tokens`: `CMDOP_GATEWAY_TOKENS` is comma-separated; a token written `ro:T`
  is read-only (GET and HEAD only); `NAME=T` (or `ro:NAME=T`) names it, and the name
  is who an approval given with it was given by. An entry that reads two ways
  (`carol=ro:T`, a token holding `=`) is refused: the gateway does not start. An
  unnamed token is called `token` and the first 8 hex digits of its SHA-256 (which
  say nothing usable about it).
- `caller_name`: the name of the token a request presents, compared as `authorize` does.
- `authorize`: the verdict on one request's `Authorization` header. The presented
  token is compared with every configured one in constant time, all of them every
  time, so the answer's timing says nothing about which token is near.
- `bind_refusal`: with no token configured the gateway is open, so it may listen on
  loopback only; any other address is refused at start.
- `RateLimiter`: a token bucket per caller (its token, else its address), the clock
  passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Literal

READ_ONLY_PREFIX = "ro:"
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
Verdict = Literal["open", "ok", "unauthenticated", "forbidden"]


NAMED = re.compile(r"^([A-Za-z][A-Za-z0-9._@-]{0,63})=([^=].*)$")


@dataclass(frozen=True)
class Tokens:
    full: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()
    names: tuple[tuple[str, str], ...] = ()  # (token, name) of the tokens given a name

    @property
    def configured(self) -> bool:
        return bool(self.full or self.read_only)


def unnamed(token: str) -> str:
    return f"token {hashlib.sha256(token.encode()).hexdigest()[:8]}"


def _named(part: str) -> tuple[str, str | None]:
    """A token and its name, for `NAME=TOKEN`; a token with no name (`=` padding
    included: `abc==` is a token, not `abc`'s) as it is."""
    found = NAMED.match(part)
    if found is None:
        return part, None
    return found.group(2).strip(), found.group(1)


class TokensError(ValueError):
    """A `CMDOP_GATEWAY_TOKENS` entry that could be read two ways; the gateway refuses to
    start on one. Its text names the entry (by its name, else its position), never the
    token."""


def parse_tokens(raw: str | None) -> Tokens:
    """The tokens of `CMDOP_GATEWAY_TOKENS`; blanks are ignored. Raises `TokensError`
    for an ambiguous entry: a token that starts with `ro:` (`carol=ro:T`: the prefix
    goes before the name, `ro:carol=T`) or holds `=` (a name written twice, or
    base64 padding: drop it)."""
    full: list[str] = []
    read_only: list[str] = []
    names: list[tuple[str, str]] = []
    for position, part in enumerate((raw or "").split(","), start=1):
        token = part.strip()
        kind = full
        if token.startswith(READ_ONLY_PREFIX):
            token = token.removeprefix(READ_ONLY_PREFIX).strip()
            kind = read_only
        token, name = _named(token)
        problem = _ambiguity(token)
        if problem is not None:
            entry = f"entry {position}" + (f" ({name})" if name is not None else "")
            raise TokensError(f"CMDOP_GATEWAY_TOKENS {entry}: {problem}")
        if token:
            kind.append(token)
            if name is not None:
                names.append((token, name))
    return Tokens(tuple(full), tuple(read_only), tuple(names))


def _ambiguity(token: str) -> str | None:
    if token.lower().startswith(READ_ONLY_PREFIX):
        return (
            "the token starts with ro:; for a read-only token write the prefix first, "
            "ro:NAME=TOKEN (as written it would be a full-access token)"
        )
    if "=" in token:
        return "the token holds '='; write NAME=TOKEN once, with no '=' in the token"
    return None


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer T` header; None for anything else."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(presented: str, candidates: tuple[str, ...]) -> bool:
    found = False
    for candidate in candidates:  # no early exit: every token is compared every time
        found |= hmac.compare_digest(presented.encode(), candidate.encode())
    return found


def authorize(tokens: Tokens, header: str | None, method: str) -> Verdict:
    """Whether a request with this `Authorization` header may use this method."""
    if not tokens.configured:
        return "open"
    presented = bearer(header)
    if presented is None:
        return "unauthenticated"
    full = _matches(presented, tokens.full)
    read_only = _matches(presented, tokens.read_only)
    if full:
        return "ok"
    if read_only:
        return "ok" if method.upper() in READ_METHODS else "forbidden"
    return "unauthenticated"


def caller_name(tokens: Tokens, header: str | None) -> str | None:
    """The name of the configured token this header presents; None for none."""
    presented = bearer(header)
    if presented is None or not _matches(presented, tokens.full + tokens.read_only):
        return None
    found = None
    for token, name in tokens.names:  # no early exit, as in `_matches`
        if hmac.compare_digest(presented.encode(), token.encode()):
            found = name
    return found or unnamed(presented)


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def bind_refusal(host: str, tokens: Tokens) -> str | None:
    """Why the gateway must not listen on `host`, or None when it may."""
    if tokens.configured or is_loopback(host):
        return None
    return (
        f"refusing to listen on {host}: no token is configured, so the gateway would be "
        "open to anyone who can reach it. Set CMDOP_GATEWAY_TOKENS (comma-separated; "
        "prefix a token with ro: for read-only), or listen on 127.0.0.1"
    )


@dataclass
class _Bucket:
    level: float
    at_s: float


@dataclass
class RateLimiter:
    """`rate_per_s` requests a second per caller, with bursts up to `burst`."""

    rate_per_s: float
    burst: int
    max_callers: int = 10_000
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def take(self, caller: str, now_s: float) -> float:
        """0.0 when the request may go ahead (one unit taken), else the seconds until
        one unit will be there."""
        bucket = self._buckets.get(caller)
        if bucket is None:
            if len(self._buckets) >= self.max_callers:
                self._forget_full(now_s)
            bucket = self._buckets[caller] = _Bucket(float(self.burst), now_s)
        elapsed = max(now_s - bucket.at_s, 0.0)
        bucket.level = min(float(self.burst), bucket.level + elapsed * self.rate_per_s)
        bucket.at_s = now_s
        if bucket.level >= 1.0:
            bucket.level -= 1.0
            return 0.0
        return (1.0 - bucket.level) / self.rate_per_s if self.rate_per_s > 0 else 60.0

    def _forget_full(self, now_s: float) -> None:
        """Drop callers whose bucket has refilled (they are as if new); if none has,
        the oldest, so a flood of new addresses cannot grow the table without bound."""
        full = [
            name
            for name, b in self._buckets.items()
            if b.level + (now_s - b.at_s) * self.rate_per_s >= self.burst
        ]
        for name in full or [min(self._buckets, key=lambda n: self._buckets[n].at_s)]:
            del self._buckets[name]
