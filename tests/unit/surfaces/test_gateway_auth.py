"""The gateway's trust boundary, decision by decision (`surfaces/gateway_auth.py`);
its enforcement through the real process is attacked in tests/e2e/test_gateway.py."""

from __future__ import annotations

import re

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.gateway_auth import (
    RateLimiter,
    Tokens,
    TokensError,
    authorize,
    bearer,
    bind_refusal,
    caller_name,
    is_loopback,
    parse_tokens,
    unnamed,
)
from cmdop_worker.surfaces.gateway_runs import approver
from cmdop_worker.surfaces.gateway_schema import openapi_document

TOKENS = parse_tokens(" full-1 , ro:read-1,,ro: ,full-2 ")


def test_tokens_are_parsed_with_ro_prefix_blanks_ignored() -> None:
    assert Tokens(full=("full-1", "full-2"), read_only=("read-1",)) == TOKENS
    assert parse_tokens(None) == parse_tokens("") == parse_tokens(" , ") == Tokens()
    assert not Tokens().configured and TOKENS.configured


@pytest.mark.parametrize(
    ("header", "method", "verdict"),
    [
        ("Bearer full-1", "POST", "ok"),
        ("Bearer full-2", "GET", "ok"),
        ("bearer   full-1  ", "DELETE", "ok"),
        ("Bearer read-1", "GET", "ok"),
        ("Bearer read-1", "head", "ok"),
        ("Bearer read-1", "POST", "forbidden"),
        ("Bearer read-1", "PUT", "forbidden"),
        ("Bearer ro:read-1", "GET", "unauthenticated"),  # the prefix is not part of it
        ("Bearer full-", "GET", "unauthenticated"),
        ("Bearer full-1x", "GET", "unauthenticated"),
        ("Bearer FULL-1", "GET", "unauthenticated"),
        ("Basic full-1", "GET", "unauthenticated"),
        ("full-1", "GET", "unauthenticated"),
        ("Bearer ", "GET", "unauthenticated"),
        ("", "GET", "unauthenticated"),
        (None, "GET", "unauthenticated"),
    ],
)
def test_authorize(header: str | None, method: str, verdict: str) -> None:
    assert authorize(TOKENS, header, method) == verdict


def test_without_tokens_every_request_is_open() -> None:
    assert authorize(Tokens(), None, "POST") == "open"
    assert bearer("Bearer  abc ") == "abc" and bearer("Token abc") is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.5", False),
        ("gateway.internal", False),
        ("", False),
    ],
)
def test_only_loopback_may_be_bound_without_tokens(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    refusal = bind_refusal(host, Tokens())
    assert (refusal is None) is loopback
    if refusal is not None:
        assert "CMDOP_GATEWAY_TOKENS" in refusal
    assert bind_refusal(host, TOKENS) is None


def test_the_rate_limiter_allows_a_burst_then_the_rate() -> None:
    limiter = RateLimiter(rate_per_s=2, burst=3)
    assert [limiter.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a", 0.0) == pytest.approx(0.5)
    assert limiter.take("b", 0.0) == 0.0  # callers have buckets of their own
    assert limiter.take("a", 0.5) == 0.0
    assert limiter.take("a", 0.5) > 0
    assert [limiter.take("a", 100.0) for _ in range(4)][:3] == [0.0, 0.0, 0.0]


def test_the_rate_limiter_forgets_callers_rather_than_grow_without_bound() -> None:
    limiter = RateLimiter(rate_per_s=1, burst=1, max_callers=10)
    for i in range(1_000):
        limiter.take(f"addr-{i}", float(i) / 1000)
    assert len(limiter._buckets) <= 10


def test_settings_keep_tokens_secret_and_read_cors_origins_as_a_list() -> None:
    settings = Settings(
        gateway_tokens="s3cret,ro:r3ad", gateway_cors_origins="https://a, https://b"
    )
    assert "s3cret" not in repr(settings) and "r3ad" not in repr(settings)
    assert settings.gateway_cors_origins == ["https://a", "https://b"]
    assert Settings().gateway_cors_origins == []


def test_the_openapi_document_uses_the_product_models() -> None:
    from cmdop_worker.models import RunRequest

    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    expected = RunRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    expected.pop("$defs", None)
    assert schemas["RunRequest"] == expected
    refs = [
        ref
        for path in doc["paths"].values()
        for op in path.values()
        for ref in _refs(op)
    ]  # fmt: skip
    assert refs and all(ref.removeprefix("#/components/schemas/") in schemas for ref in refs)


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


NAMED = parse_tokens("alice=s3cret, ro:dash=r3ad, plain, ro:ci@example.org=c1")


def test_a_token_may_be_named() -> None:
    assert NAMED.full == ("s3cret", "plain")
    assert NAMED.read_only == ("r3ad", "c1")
    assert dict(NAMED.names) == {"s3cret": "alice", "r3ad": "dash", "c1": "ci@example.org"}


@pytest.mark.parametrize(
    ("raw", "entry"),
    [
        ("alice=AAAA1111, carol=ro:CCCC3333", "entry 2 (carol)"),  # prefix after the name
        ("carol=RO:CCCC3333", "entry 1 (carol)"),
        ("ro:ro:CCCC3333", "entry 1:"),
        ("ok1, ro:carol=ro:CCCC3333", "entry 2 (carol)"),
        ("bob=BBBB=2222", "entry 1 (bob)"),  # a name written twice
        ("ok1, abcBBBB==", "entry 2:"),  # base64 padding: '=' in a token
        ("=xBBBB", "entry 1:"),
        ("1a=BBBB", "entry 1:"),
        ("a=", "entry 1:"),
    ],
)
def test_an_entry_that_reads_two_ways_is_refused_naming_it_not_its_token(
    raw: str, entry: str
) -> None:
    with pytest.raises(TokensError) as refused:
        parse_tokens(raw)
    said = str(refused.value)
    assert said.startswith(f"CMDOP_GATEWAY_TOKENS {entry}")
    assert "\n" not in said
    assert not re.search(r"CCCC|BBBB|3333|2222", said)


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("Bearer s3cret", "alice"),
        ("Bearer r3ad", "dash"),  # a read-only token is still someone
        ("Bearer c1", "ci@example.org"),
        ("Bearer plain", unnamed("plain")),
        ("Bearer alice=s3cret", None),  # the name is not part of the token
        ("Bearer alice", None),
        ("Bearer wrong", None),
        (None, None),
    ],
)
def test_the_caller_is_its_tokens_name(header: str | None, name: str | None) -> None:
    assert caller_name(NAMED, header) == name


def test_an_unnamed_token_is_known_by_a_hash_that_does_not_show_it() -> None:
    shown = unnamed("tok-full-7f3a9c")
    assert re.fullmatch(r"token [0-9a-f]{8}", shown) and "7f3a9c" not in shown
    assert unnamed("tok-full-7f3a9c") == shown != unnamed("tok-full-7f3a9d")


@pytest.mark.parametrize(
    ("caller", "said", "by"),
    [
        ("alice", None, "alice"),
        ("alice", "alice", "alice"),
        ("slack-bot", "bob", "bob (via slack-bot)"),  # a token answering for someone
        (None, "bob", "bob"),  # no tokens: the body is all there is
        (None, None, "gateway"),
    ],
)
def test_an_approval_is_given_by_the_token(caller: str | None, said: str | None, by: str) -> None:
    assert approver(caller, said) == by
