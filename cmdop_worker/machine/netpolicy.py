"""Which destinations a tool may reach: the policy's `[sandbox] network` value, and the
decision for one destination.

    network = "none"                                  # no network at all (the default)
    network = "any"                                   # anywhere but the fleet and this machine
    network = ["pypi.org", "*.debian.org:443", "10.20.0.0/16", "127.0.0.1:9090"]

`true` and `false` still mean "any" and "none". A tool's processes run in a network
namespace of their own, with no route anywhere; whatever they reach goes through the
worker's egress proxy (`egress`), which asks `verdict` about each destination after
resolving it itself. The fleet's own endpoints (Redis, the broker, the result backend,
the gateway) are refused whatever the policy says, on their hosts and on every address
of this machine. "any" refuses this machine (loopback, its own addresses), link-local
(cloud metadata) and multicast too; a list admits this machine's addresses only where an
entry names them by address (`127.0.0.1:9090`), never through a name or a wide CIDR.

Pure: no sockets, no resolver, no clock. Used by `policy` (parsing) and `egress`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
NetworkMode = Literal["none", "any", "list"]

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_DEFAULT_PORTS = {
    "redis": 6379,
    "rediss": 6379,
    "sentinel": 26379,
    "amqp": 5672,
    "amqps": 5671,
    "http": 80,
    "https": 443,
}
_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
# "This network" (RFC 1122): no destination; the kernel may route it anywhere local.
_THIS_NETWORK = (ipaddress.ip_network("0.0.0.0/8"),)


@dataclass(frozen=True)
class Destination:
    """One entry of an allowlist: a host name (`*.` for its subdomains) or an address
    or network, with a port or any port."""

    text: str
    name: str | None = None
    network: IPNetwork | None = None
    port: int | None = None

    def admits(self, host: str, address: IPAddress, port: int) -> bool:
        if self.port is not None and port != self.port:
            return False
        if self.network is not None:
            return address in self.network
        return self.names(host)

    def names(self, host: str) -> bool:
        """A name entry's match: `*.domain` any subdomain, else the name itself."""
        if self.name is None:
            return False
        if self.name.startswith("*."):
            return host.endswith(self.name[1:])
        return host == self.name

    def names_explicitly(self, address: IPAddress) -> bool:
        """True when this entry opens `address` of this machine: it is the entry's one
        address, or the entry lies inside loopback or link-local and holds it."""
        if self.network is None or address not in self.network:
            return False
        if self.network.num_addresses == 1:
            return True
        first, last = self.network[0], self.network[-1]
        return any(first in net and last in net for net in (*_LOOPBACK, *_LINK_LOCAL))


@dataclass(frozen=True)
class NetworkPolicy:
    mode: NetworkMode = "none"
    allowed: tuple[Destination, ...] = ()

    def __bool__(self) -> bool:
        """True when tools reach any network at all."""
        return self.mode != "none"

    def __str__(self) -> str:
        if self.mode == "list":
            return ", ".join(entry.text for entry in self.allowed)
        return self.mode


NO_NETWORK = NetworkPolicy()
NO_NETWORK_REASON = "tools have no network here ([sandbox] network = none)"


def parse_network(value: Any) -> NetworkPolicy:
    """The `[sandbox] network` value: "none", "any", true, false or a list of entries."""
    if value is True or value == "any":
        return NetworkPolicy("any")
    if value is False or value == "none":
        return NO_NETWORK
    if isinstance(value, str):
        raise ValueError(f'network must be "none", "any", true, false or a list; got {value!r}')
    if not isinstance(value, Sequence):
        raise ValueError(f"network must be a string, a boolean or a list; got {value!r}")
    entries = tuple(parse_destination(item) for item in value)
    return NetworkPolicy("list", entries) if entries else NO_NETWORK


def parse_destination(text: Any) -> Destination:
    """`host`, `*.domain`, `host:port`, an address, `[v6]:port`, or a CIDR."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"network entry {text!r}: expected a host, an address or a CIDR")
    raw = text.strip()
    host, port = _split_port(raw)
    if "/" in host:
        if port is not None:
            raise ValueError(f"network entry {raw!r}: a CIDR takes no port")
        try:
            return Destination(raw, network=ipaddress.ip_network(host))
        except ValueError as exc:
            raise ValueError(f"network entry {raw!r}: bad CIDR ({exc})") from None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return Destination(raw, name=_checked_name(raw, host), port=port)
    return Destination(raw, network=ipaddress.ip_network(address), port=port)


def _split_port(raw: str) -> tuple[str, int | None]:
    if raw.startswith("["):
        host, sep, rest = raw[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"network entry {raw!r}: expected [address]:port")
        return host, _port(raw, rest[1:]) if rest else None
    if raw.count(":") == 1:
        host, _, port = raw.partition(":")
        return host, _port(raw, port)
    return raw, None  # a bare name or address, IPv6 included


def _port(raw: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"network entry {raw!r}: port must be 1-65535")
    return int(text)


def _checked_name(raw: str, host: str) -> str:
    name = host.lower().rstrip(".")
    labels = name[2:].split(".") if name.startswith("*.") else name.split(".")
    if not name or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"network entry {raw!r}: not a host name, address or CIDR")
    return name


@dataclass(frozen=True)
class Fleet:
    """The fleet's own endpoints, as this machine sees them: `(address, port)` pairs,
    and the ports alone (refused on every address of this machine)."""

    endpoints: frozenset[tuple[IPAddress, int]] = frozenset()

    @property
    def ports(self) -> frozenset[int]:
        return frozenset(port for _, port in self.endpoints)

    @property
    def hosts(self) -> frozenset[IPAddress]:
        return frozenset(address for address, _ in self.endpoints)


def fleet_hosts(urls: Iterable[str]) -> list[tuple[str, int]]:
    """`(host, port)` of each service URL (`redis://:pw@host:6379/0`, `amqp://…`,
    `sentinel://h1:26379;sentinel://h2:26379`, `http://gateway:8080`); sockets skipped."""
    found = []
    for url in urls:
        for part in url.split(";"):
            parsed = urlsplit(part.strip())
            if parsed.hostname is None:
                continue
            try:
                port = parsed.port or _DEFAULT_PORTS.get(parsed.scheme)
            except ValueError:
                port = None
            if port is not None:
                found.append((parsed.hostname, port))
    return found


# Redis on a unix socket: `unix://` (redis-py), `redis+socket://` (kombu, Celery).
SOCKET_SCHEMES = frozenset({"unix", "redis+socket", "redis-socket", "rediss+socket", "socket"})


def fleet_sockets(urls: Iterable[str]) -> list[str]:
    """The unix socket path of each service URL that names one (`unix:///run/r.sock`,
    `redis+socket:///srv/redis/redis.sock?db=0`), in order, each once."""
    found: list[str] = []
    for url in urls:
        for part in url.split(";"):
            parsed = urlsplit(part.strip())
            if parsed.scheme.lower() in SOCKET_SCHEMES and parsed.path.startswith("/"):
                found.append(unquote(parsed.path))
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str
    addresses: tuple[IPAddress, ...] = ()  # what to connect to: exactly what was checked


def canonical(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (`::ffff:127.0.0.1`) is the IPv4 address it maps."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def refused_unresolved(host: str, port: int, policy: NetworkPolicy) -> str | None:
    """The refusal that needs no lookup: no network, or a list no entry of which could
    admit `host:port`. A name no entry covers is never sent to a resolver, where its
    text would leave the machine (a DNS query is a message)."""
    if policy.mode == "none":
        return NO_NETWORK_REASON
    if policy.mode == "any":
        return None
    name = host.lower().rstrip(".").strip("[]")
    for entry in policy.allowed:
        if entry.port in (None, port) and (entry.network is not None or entry.names(name)):
            return None
    return f"{host}:{port} is not in the policy's network list"


def verdict(
    host: str,
    port: int,
    addresses: Iterable[IPAddress],
    local: Iterable[IPAddress],
    policy: NetworkPolicy,
    fleet: Fleet,
) -> Verdict:
    """May a tool reach `host:port`, which resolved to `addresses` (those of them in
    `local` are this machine's)? Every address must pass: a name that resolves to one
    good and one internal address is refused as a whole."""
    if policy.mode == "none":
        return Verdict(False, NO_NETWORK_REASON)
    if not 0 < port < 65536:
        # The socket layer takes a port modulo 65536: an unchecked 6379 + 65536 would
        # pass every comparison with the fleet's ports and still reach 6379.
        return Verdict(False, f"port {port} is not a TCP port (1-65535)")
    resolved = tuple(dict.fromkeys(canonical(a) for a in addresses))
    if not resolved:
        return Verdict(False, f"{host} did not resolve")
    mine = {canonical(a) for a in local} | {a for a in resolved if _in(a, _LOOPBACK)}
    name = host.lower().rstrip(".").strip("[]")
    for address in resolved:
        refused = _refusal(name, address, port, address in mine, policy, fleet)
        if refused is not None:
            return Verdict(False, refused)
    return Verdict(True, "allowed", resolved)


def _refusal(
    host: str, address: IPAddress, port: int, mine: bool, policy: NetworkPolicy, fleet: Fleet
) -> str | None:
    shown = f"[{host}]" if ":" in host else host
    where = f"{shown}:{port}" if host == str(address) else f"{shown}:{port} ({address})"
    if address.is_unspecified:
        return f"{where} is this machine (the unspecified address)"
    if (address, port) in fleet.endpoints or (mine and port in fleet.ports):
        return f"{where} is the fleet's own Redis, broker or gateway"
    internal = _internal_kind(address, mine)
    if policy.mode == "any":
        if internal:
            return f"{where} is {internal}; a list entry naming it may allow it"
        if address in fleet.hosts:
            return f"{where} is a host of the fleet's Redis, broker or gateway"
        return None
    entries = [entry for entry in policy.allowed if entry.admits(host, address, port)]
    if not entries:
        return f"{where} is not in the policy's network list"
    if internal and not any(entry.names_explicitly(address) for entry in entries):
        return f"{where} is {internal}; only an entry naming its address may allow it"
    return None


def _internal_kind(address: IPAddress, mine: bool) -> str | None:
    if _in(address, _LOOPBACK):
        return "loopback"
    if _in(address, _LINK_LOCAL):
        return "link-local (cloud metadata)"
    if _in(address, _THIS_NETWORK):
        return "in 0.0.0.0/8 (this network, no destination)"
    if mine:
        return "an address of this machine"
    if address.is_multicast:
        return "multicast"
    return None


def _in(address: IPAddress, networks: Sequence[IPNetwork]) -> bool:
    return any(address in network for network in networks if network.version == address.version)
