"""What the gateway serves to a browser, decision by decision
(`surfaces/gateway_browser.py`) and what it reads (`surfaces/gateway_input.py`); the
enforcement is attacked from chromium in tests/e2e/test_gateway_browser.py and over HTTP
in tests/e2e/test_gateway_input.py."""

from __future__ import annotations

import json

import pytest

from cmdop_worker.surfaces.gateway_browser import (
    HostRule,
    client_header_refusal,
    content_type_refusal,
    host_allowed,
    host_rules,
    hosts_refusal,
    parse_rules,
    site_refusal,
    split_host,
)
from cmdop_worker.surfaces.gateway_input import MAX_DEPTH, BadInput, json_object, seq

LOOPBACK = host_rules("127.0.0.1", 8080, [])


@pytest.mark.parametrize(
    ("header", "allowed"),
    [
        ("127.0.0.1:8080", True),
        ("localhost:8080", True),
        ("LocalHost:8080", True),
        ("[::1]:8080", True),
        ("localhost.:8080", True),
        ("127.0.0.1", True),  # no port: not a browser; matched by name
        ("127.0.0.1:8081", False),
        ("evil.test:8080", False),
        ("localhost.evil.test:8080", False),
        ("127.0.0.2:8080", False),
        ("[::1", False),
        ("[::1]x", False),
        ("localhost:80a", False),
        ("localhost:99999", False),
        ("a b:8080", False),
        ("*", False),
        ("", False),
        (None, False),
    ],
)
def test_a_loopback_gateway_answers_to_its_loopback_names_only(header, allowed) -> None:
    assert host_allowed(header, LOOPBACK) is allowed


def test_the_rules_for_each_kind_of_bind() -> None:
    named = parse_rules(["gw.example.com", "*.fleet.test", "10.0.0.5:8080", "fd00::1"])
    assert named == [
        HostRule("gw.example.com"),
        HostRule("*.fleet.test"),
        HostRule("10.0.0.5", 8080),
        HostRule("[fd00::1]"),
    ]
    wildcard = host_rules("0.0.0.0", 8080, named)
    assert host_allowed("gw.example.com:443", wildcard)
    assert host_allowed("a.fleet.test", wildcard) and not host_allowed("fleet.test", wildcard)
    assert host_allowed("10.0.0.5:8080", wildcard) and not host_allowed("10.0.0.5:9", wildcard)
    assert host_allowed("[fd00::1]:8080", wildcard) and host_allowed("localhost:8080", wildcard)
    lan = host_rules("10.0.0.7", 8080, [])
    assert host_allowed("10.0.0.7:8080", lan) and not host_allowed("localhost:8080", lan)
    assert host_allowed("[::1]:8080", host_rules("::1", 8080, []))
    assert host_allowed("anything:1", host_rules("10.0.0.7", 8080, parse_rules(["*"])))


@pytest.mark.parametrize("entry", ["gw.test:http", "a b", "[::1", "gw..test:", "*.*.x", "x:-1"])
def test_a_malformed_allowed_host_is_named(entry) -> None:
    with pytest.raises(ValueError, match="CMDOP_GATEWAY_ALLOWED_HOSTS"):
        parse_rules([entry])
    assert split_host(entry) is None


@pytest.mark.parametrize(
    ("bind", "allowed", "tokens", "words"),
    [
        ("127.0.0.1", [], False, None),
        ("0.0.0.0", [], True, "set CMDOP_GATEWAY_ALLOWED_HOSTS"),
        ("::", [], True, "set CMDOP_GATEWAY_ALLOWED_HOSTS"),
        ("0.0.0.0", ["gw.test"], True, None),
        ("0.0.0.0", ["*"], True, None),
        ("127.0.0.1", ["*"], False, "=* with no token"),
        ("10.0.0.7", [], True, None),
    ],
)
def test_when_it_refuses_to_start(bind, allowed, tokens, words) -> None:
    refusal = hosts_refusal(bind, parse_rules(allowed), tokens)
    assert refusal is None if words is None else words in (refusal or "")


@pytest.mark.parametrize(
    ("header", "refused"),
    [
        ("application/json", None),
        ("Application/JSON", None),
        ("application/json; charset=utf-8", None),
        ('application/json;charset="UTF-8"', None),
        ("application/json; charset=latin-1", "must be UTF-8"),
        ("text/plain", "is not application/json"),
        ("text/plain; charset=UTF-8", "is not application/json"),
        ("application/x-www-form-urlencoded", "is not application/json"),
        ("multipart/form-data; boundary=x", "is not application/json"),
        ("application/jsonp", "is not application/json"),
        ("", "needs Content-Type"),
        (None, "needs Content-Type"),
    ],
)
def test_a_post_body_is_declared_json(header, refused) -> None:
    found = content_type_refusal(header)
    assert found is None if refused is None else refused in (found or "")


def test_the_client_header_is_asked_of_token_less_writes_only() -> None:
    assert client_header_refusal(False, "POST", None) is not None
    assert client_header_refusal(False, "POST", "  ") is not None
    assert client_header_refusal(False, "POST", "curl") is None
    assert client_header_refusal(False, "GET", None) is None
    assert client_header_refusal(True, "POST", None) is None  # a token is what it needs


@pytest.mark.parametrize(
    ("site", "origin", "cors", "refused"),
    [
        (None, None, [], False),  # not a browser
        ("same-origin", "http://127.0.0.1:8080", [], False),
        ("none", None, [], False),  # typed in the address bar
        ("same-site", "http://127.0.0.1:9000", [], True),  # another port of the same host
        ("cross-site", "http://evil.test", [], True),
        ("cross-site", None, [], True),
        ("cross-site", "https://dash.example", ["https://dash.example"], False),
        ("cross-site", "https://evil.example", ["https://dash.example"], True),
        ("cross-site", "https://evil.example", ["*"], False),
    ],
)
def test_a_browser_request_from_another_site(site, origin, cors, refused) -> None:
    assert (site_refusal(site, origin, cors) is not None) is refused


@pytest.mark.parametrize(
    ("raw", "value"), [("0", 0), ("42", 42), (" 7\t", 7), ("9" * 20, int("9" * 20))]
)
def test_a_resume_point_is_ascii_digits(raw, value) -> None:
    assert seq(raw, "after") == value


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("\u00b2", "is not a seq"),
        ("\u0663", "is not a seq"),
        ("\uff11", "is not a seq"),  # a fullwidth 1
        ("-1", "is not a seq"),
        ("+1", "is not a seq"),
        ("1.0", "is not a seq"),
        ("", "is not a seq"),
        ("9" * 21, "more than 20 digits"),
        ("9" * 5000, "more than 20 digits"),
    ],
)
def test_a_malformed_resume_point_is_named(raw, words) -> None:
    with pytest.raises(BadInput, match=words):
        seq(raw, "Last-Event-ID")


def nested(levels: int) -> bytes:
    return json.dumps({"a": json.loads("[" * (levels - 1) + "]" * (levels - 1))}).encode()


def test_a_body_nested_to_the_limit_is_read_one_deeper_is_not() -> None:
    assert json_object(nested(MAX_DEPTH))["a"] is not None
    with pytest.raises(BadInput, match=f"nested deeper than {MAX_DEPTH}"):
        json_object(nested(MAX_DEPTH + 1))
    for levels in (900, 5000, 200_000):  # past the parser's own recursion limit too
        with pytest.raises(BadInput, match="nested deeper"):
            json_object(b"[" * levels + b"]" * levels)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"\xff", "not UTF-8"),
        (b'{"a": "\xed\xa0\x80"}', "not UTF-8"),  # a surrogate encoded as UTF-8 bytes
        (b'{"a": "\\udc00"}', "unpaired surrogate"),
        (b'{"\\ud800": 1}', "unpaired surrogate"),
        (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"a": -1e400}', "the number -1e400 is out of range"),
        (b'{"a": ' + b"1" * 4301 + b"}", "more than 4300 digits"),
        (b"[]", "not an array"),
        (b"true", "not a boolean"),
        (b"{", "not JSON"),
    ],
)
def test_a_malformed_body_is_named(raw, words) -> None:
    with pytest.raises(BadInput, match=words):
        json_object(raw)


def test_a_well_formed_body_is_read() -> None:
    assert json_object(b"") == json_object(b"  \n") == {}
    assert json_object(b'{"a": "caf\\u00e9 \\ud83d\\ude00", "n": 1e300}') == {
        "a": "café 😀",
        "n": 1e300,
    }
