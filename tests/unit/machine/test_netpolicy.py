"""The network policy: parsing `[sandbox] network`, and the verdict on one destination."""

from __future__ import annotations

import ipaddress

import pytest

from cmdop_worker.machine.netpolicy import (
    Fleet,
    NetworkPolicy,
    fleet_hosts,
    parse_destination,
    parse_network,
    refused_unresolved,
    verdict,
)
from cmdop_worker.machine.policy import Policy, load_policy, tools_have_network

ip = ipaddress.ip_address
REDIS = ip("127.0.0.1")
FLEET = Fleet(frozenset({(REDIS, 6379), (ip("10.0.0.7"), 5672)}))
ANY = parse_network("any")
OWN = ip("192.168.5.20")  # "this machine's" address in these tables


def decide(host: str, port: int, *addresses: str, policy: NetworkPolicy = ANY) -> str | None:
    """None when allowed, else the reason."""
    resolved = [ip(a) for a in addresses]
    local = [a for a in resolved if a == OWN]
    out = verdict(host, port, resolved, local, policy, FLEET)
    return None if out.allowed else out.reason


@pytest.mark.parametrize(
    ("value", "mode"),
    [(True, "any"), (False, "none"), ("any", "any"), ("none", "none"), ([], "none")],
)
def test_the_legacy_booleans_and_the_words(value: object, mode: str) -> None:
    assert parse_network(value).mode == mode


def test_the_default_is_no_network_and_tools_have_network_says_so() -> None:
    assert load_policy({}).sandbox.network.mode == "none"
    assert not tools_have_network(Policy())
    assert tools_have_network(Policy(), sandboxed=False)  # nothing to take it away
    assert tools_have_network(load_policy({"sandbox": {"network": ["pypi.org"]}}))
    assert tools_have_network(load_policy({"sandbox": {"network": True}}))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "expected a host"),
        ("   ", "expected a host"),
        ("10.0.0.1/8", "host bits set"),
        ("10.0.0.0/33", "bad CIDR"),
        ("10.0.0.0/8:443", "takes no port"),
        ("a b", "not a host name"),
        ("*", "not a host name"),
        ("exa_mple..com", "not a host name"),
        ("host:0", "port must be 1-65535"),
        ("host:99999", "port must be 1-65535"),
        ("host:http", "port must be 1-65535"),
        ("[::1", "expected [address]:port"),
    ],
)
def test_a_bad_entry_is_refused_by_name(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match="network entry") as caught:
        parse_destination(text)
    assert problem in str(caught.value)


@pytest.mark.parametrize("value", ["yes", "on", 1, {"any": True}, ["ok.com", 5]])
def test_a_bad_value_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="network"):
        load_policy({"sandbox": {"network": value}})


def test_entries_parse_to_names_addresses_and_networks() -> None:
    parsed = parse_network(["Pypi.org.", "*.debian.org:443", "10.20.0.0/16", "[::1]:9090", "::1"])
    assert [(d.name, str(d.network), d.port) for d in parsed.allowed] == [
        ("pypi.org", "None", None),
        ("*.debian.org", "None", 443),
        (None, "10.20.0.0/16", None),
        (None, "::1/128", 9090),
        (None, "::1/128", None),
    ]


@pytest.mark.parametrize(
    ("host", "port", "addresses", "why"),
    [
        ("127.0.0.1", 6379, ["127.0.0.1"], "fleet's own"),
        ("localhost", 6379, ["127.0.0.1", "::1"], "fleet's own"),
        ("::1", 6379, ["::1"], "fleet's own"),
        ("::1", 8080, ["::1"], "loopback"),
        ("::ffff:127.0.0.1", 6379, ["::ffff:127.0.0.1"], "fleet's own"),
        ("0.0.0.0", 6379, ["0.0.0.0"], "unspecified"),
        ("::", 80, ["::"], "unspecified"),
        ("2130706433", 6379, ["127.0.0.1"], "fleet's own"),
        ("127.0.0.1", 8080, ["127.0.0.1"], "loopback"),
        ("127.1.2.3", 22, ["127.1.2.3"], "loopback"),
        ("192.168.5.20", 6379, ["192.168.5.20"], "fleet's own"),  # Redis on 0.0.0.0
        ("192.168.5.20", 5432, ["192.168.5.20"], "this machine"),
        ("169.254.169.254", 80, ["169.254.169.254"], "link-local"),
        ("fe80::1", 80, ["fe80::1"], "link-local"),
        ("rabbit", 5672, ["10.0.0.7"], "fleet's own"),
        ("rabbit", 15672, ["10.0.0.7"], "host of the fleet"),
        ("rebind.example", 443, ["93.184.216.34", "127.0.0.1"], "loopback"),
        ("nowhere.example", 443, [], "did not resolve"),
        ("224.0.0.1", 80, ["224.0.0.1"], "multicast"),
    ],
)
def test_any_refuses_the_fleet_and_this_machine(
    host: str, port: int, addresses: list[str], why: str
) -> None:
    reason = decide(host, port, *addresses)
    assert reason is not None and why in reason, reason


@pytest.mark.parametrize(
    ("host", "addresses"),
    [
        ("pypi.org", ["151.101.0.223"]),
        ("db.internal", ["10.1.2.3", "10.1.2.4"]),
        ("x", ["2a00::1"]),
    ],
)
def test_any_allows_the_rest_and_connects_to_what_it_checked(
    host: str, addresses: list[str]
) -> None:
    out = verdict(host, 443, [ip(a) for a in addresses], [], ANY, FLEET)
    assert out.allowed and [str(a) for a in out.addresses] == addresses


def test_none_refuses_everything() -> None:
    assert "network = none" in (
        decide("pypi.org", 443, "151.101.0.223", policy=parse_network(False)) or ""
    )


LIST = parse_network(
    [
        "pypi.org",
        "*.debian.org:443",
        "10.20.0.0/16",
        "127.0.0.1:9090",
        "127.0.0.1:6379",
        "0.0.0.0/0",
    ]
)


@pytest.mark.parametrize(
    ("host", "port", "addresses", "allowed"),
    [
        ("pypi.org", 443, ["151.101.0.223"], True),
        ("PyPI.org.", 80, ["151.101.0.223"], True),
        ("evil.org", 443, ["151.101.0.223"], True),  # "0.0.0.0/0" admits it by address
        ("deb.debian.org", 443, ["151.101.2.132"], True),
        ("deb.debian.org", 80, ["151.101.2.132"], True),  # again through 0.0.0.0/0
        ("10.20.3.4", 5432, ["10.20.3.4"], True),
        ("127.0.0.1", 9090, ["127.0.0.1"], True),  # named by its address: allowed
        ("127.0.0.1", 9091, ["127.0.0.1"], False),  # loopback, not named: 0.0.0.0/0 is no name
        ("127.0.0.1", 6379, ["127.0.0.1"], False),  # listed, but the fleet's Redis
        ("localhost", 9090, ["127.0.0.1"], True),  # the address is named, whatever the name
        ("pypi.org", 443, ["127.0.0.1"], False),  # a listed name pointing at loopback
        ("192.168.5.20", 22, ["192.168.5.20"], False),  # this machine, not named
        ("169.254.169.254", 80, ["169.254.169.254"], False),
    ],
)
def test_a_list_admits_what_it_names(
    host: str, port: int, addresses: list[str], allowed: bool
) -> None:
    assert (decide(host, port, *addresses, policy=LIST) is None) is allowed


def test_a_list_without_a_wide_entry_refuses_what_it_does_not_name() -> None:
    narrow = parse_network(["pypi.org", "*.debian.org"])
    assert "not in the policy's network list" in (
        decide("evil.org", 443, "151.101.0.223", policy=narrow) or ""
    )
    assert decide("debian.org", 443, "151.101.2.132", policy=narrow) is not None  # apex
    assert decide("ftp.debian.org", 21, "151.101.2.132", policy=narrow) is None


def test_a_loopback_network_entry_opens_loopback_but_a_wide_one_does_not() -> None:
    assert decide("127.0.0.2", 80, "127.0.0.2", policy=parse_network(["127.0.0.0/8"])) is None
    assert decide("127.0.0.2", 80, "127.0.0.2", policy=parse_network(["0.0.0.0/1"])) is not None
    own = parse_network(["192.168.5.20:8000"])
    assert decide("192.168.5.20", 8000, "192.168.5.20", policy=own) is None


def test_the_fleet_is_read_from_every_kind_of_url() -> None:
    urls = [
        "redis://:pw@127.0.0.1:6400/0",
        "rediss://user:pw@redis.example",
        "sentinel://h1:26379;sentinel://h2",
        "unix:///run/redis.sock",
        "amqp://guest@rabbit//",
        "http://[::1]:8080",
    ]
    assert fleet_hosts(urls) == [
        ("127.0.0.1", 6400),
        ("redis.example", 6379),
        ("h1", 26379),
        ("h2", 26379),
        ("rabbit", 5672),
        ("::1", 8080),
    ]


@pytest.mark.parametrize(
    ("host", "port", "network", "refused"),
    [
        ("anything.example", 443, "any", False),
        ("anything.example", 443, "none", True),
        ("secret.attacker.example", 443, ["pypi.org"], True),
        ("pypi.org", 80, ["pypi.org:443"], True),
        ("PyPI.org.", 443, ["pypi.org:443"], False),
        ("a.b.debian.org", 21, ["*.debian.org"], False),
        ("db.internal", 5432, ["10.20.0.0/16"], False),  # an address entry needs the lookup
        ("db.internal", 5432, ["10.20.0.5:6432"], True),  # ... unless its port rules it out
    ],
)
def test_what_is_refused_before_any_lookup(
    host: str, port: int, network: object, refused: bool
) -> None:
    assert (refused_unresolved(host, port, parse_network(network)) is not None) is refused


@pytest.mark.parametrize("wraps", [1, 2])
def test_a_port_past_65535_never_wraps_onto_the_fleet(wraps: int) -> None:
    """The socket layer takes a port modulo 65536: past the range it is refused."""
    internal = parse_network(["10.0.0.0/8", "127.0.0.1"])
    assert decide("10.0.0.7", 5672 + wraps * 65536, "10.0.0.7", policy=internal) is not None
    assert decide("127.0.0.1", 6379 + wraps * 65536, "127.0.0.1", policy=internal) is not None
    assert decide("10.0.0.7", 8080, "10.0.0.7", policy=internal) is None  # the control


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_a_port_outside_1_to_65535_is_refused(port: int) -> None:
    reason = decide("10.0.0.7", port, "10.0.0.7", policy=parse_network(["10.0.0.0/8"]))
    assert reason == f"port {port} is not a TCP port (1-65535)"


@pytest.mark.parametrize("host", ["0.0.0.1", "0.1.2.3", "0.255.255.255"])
def test_this_network_is_no_destination_in_any(host: str) -> None:
    assert "0.0.0.0/8" in (decide(host, 8080, host) or "")
