"""The worker's egress proxy: the only way out of a tool's network namespace.

One per machine worker, started when its policy gives tools network
(`MachineSide.egress`), listening on a unix socket that each sandbox gets bound in
(`sandbox.confined_argv`) and reaches through its bridge (`egress_bridge`). It speaks
HTTP CONNECT, plain-HTTP forwarding (`GET http://host/…`) and SOCKS5 (no auth,
CONNECT; both in `egress_wire`). For each request it first refuses, unresolved, what
no entry of a list could admit (`netpolicy.refused_unresolved`: a DNS query for a
name nobody allowed would carry its text out); then it resolves the destination
itself, learns which of the addresses are this machine's, asks `netpolicy.verdict`,
and connects to exactly the addresses it checked, never to a name resolved again (DNS
rebinding). A refusal is a 403 whose body says why (SOCKS5: "not allowed by
ruleset"), and a warning in the log.

The fleet's endpoints come from the worker's own settings (Redis, broker, result
backend, gateway URLs) and are resolved again every `FLEET_REFRESH_S`. A lookup that
fails keeps what that host resolved to before, and is tried again at the next request;
until every fleet host has resolved once, all egress is refused (a fleet Redis whose
name did not resolve would otherwise be as open as any other address).
"""

from __future__ import annotations

import contextlib
import glob
import ipaddress
import logging
import os
import socket
import socketserver
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from cmdop_worker.machine.egress_bridge import DRAIN_S, IDLE_S, splice
from cmdop_worker.machine.egress_wire import Refused, http_request, socks5_request
from cmdop_worker.machine.netpolicy import (
    Fleet,
    IPAddress,
    NetworkPolicy,
    Verdict,
    fleet_hosts,
    refused_unresolved,
    verdict,
)

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
FLEET_REFRESH_S = 30.0
MAX_CONNECTIONS = 256
STOP_POLL_S = 0.1  # how soon `stop` is seen by the accepting thread
PROXY_DIR_PREFIX = "cmdop-egress-"
PROXY_SOCKET = "egress.sock"


class EgressProxy:
    """The proxy's socket and threads. `decide` and `open` are its whole policy."""

    def __init__(
        self,
        policy: NetworkPolicy,
        fleet_urls: Sequence[str],
        *,
        idle_s: float = IDLE_S,
        drain_s: float = DRAIN_S,
    ) -> None:
        self.policy = policy
        self.idle_s, self.drain_s = idle_s, drain_s  # see `splice`
        self._fleet_hosts = fleet_hosts(fleet_urls)
        self._known: dict[tuple[str, int], list[IPAddress]] = {}
        self._fleet_at = float("-inf")
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix=PROXY_DIR_PREFIX)
        self.socket_path = os.path.join(self._dir, PROXY_SOCKET)
        self._server: _Server | None = None

    def start(self) -> EgressProxy:
        server = _Server(self.socket_path, _Handler)
        server.proxy = self
        # A tool may run as another user (CMDOP_TOOL_USER): it must reach the socket.
        os.chmod(self._dir, 0o711)
        os.chmod(self.socket_path, 0o666)
        serve = threading.Thread(target=server.serve_forever, args=(STOP_POLL_S,), daemon=True)
        serve.start()
        self._server = server
        log.info("egress proxy for tools on %s (network: %s)", self.socket_path, self.policy)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
            os.rmdir(self._dir)

    @property
    def connections(self) -> int:
        """How many connections the proxy holds open now."""
        return self._server.active if self._server is not None else 0

    def fleet(self) -> Fleet | str:
        """The fleet's endpoints, resolved now and then (a host may move); a refusal's
        reason while a fleet host has never resolved."""
        with self._lock:
            if time.monotonic() - self._fleet_at > FLEET_REFRESH_S:
                failed = refresh_fleet(self._fleet_hosts, self._known)
                if not failed:  # else tried again at the next request
                    self._fleet_at = time.monotonic()
            unknown = [f"{h}:{p}" for h, p in self._fleet_hosts if (h, p) not in self._known]
            if unknown:
                return (
                    f"the fleet's {', '.join(unknown)} does not resolve, so what is the fleet's "
                    "cannot be told apart: no connection is allowed until it does"
                )
            endpoints = {(a, port) for (_, port), found in self._known.items() for a in found}
            return Fleet(frozenset(endpoints))

    def decide(self, host: str, port: int) -> Verdict:
        early = refused_unresolved(host, port, self.policy)
        if early is not None:
            return Verdict(False, early)
        fleet = self.fleet()
        if isinstance(fleet, str):
            return Verdict(False, fleet)
        addresses = resolve(host, port)
        return verdict(host, port, addresses, local_of(addresses), self.policy, fleet)

    def open(self, host: str, port: int) -> socket.socket:
        """A connection to `host:port` if the policy allows it; else `Refused`."""
        decided = self.decide(host, port)
        if not decided.allowed:
            log.warning("egress refused %s:%s: %s", host, port, decided.reason)
            raise Refused(403, decided.reason)
        errors = []
        for address in decided.addresses:  # exactly the addresses that were checked
            try:
                upstream = socket.create_connection((str(address), port), CONNECT_TIMEOUT_S)
            except OSError as exc:
                errors.append(f"{address}: {exc.strerror or exc}")
                continue
            upstream.settimeout(None)
            return upstream
        raise Refused(502, f"cannot connect to {host}:{port}: {'; '.join(errors)}")


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to ([] when it does not): numeric forms such as
    `2130706433` or `0x7f000001` come back as the address they spell."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [ipaddress.ip_address(str(info[4][0])) for info in infos]


def local_of(addresses: Sequence[IPAddress]) -> list[IPAddress]:
    """Those of `addresses` that belong to this machine: a socket can bind them. A host
    that lets any address be bound (`ip_nonlocal_bind`) counts them all as its own."""
    found = []
    for address in addresses:
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((str(address), 0))
            except OSError:
                continue
            found.append(address)
    return found


def proxy_sockets(own: str | None) -> list[str]:
    """The sockets of the other egress proxies on this host (sibling machine workers,
    under the same temporary directory): a tool may use only its own worker's, whose
    policy is its own; a sandbox that shows the host's /tmp hides the others."""
    pattern = os.path.join(tempfile.gettempdir(), PROXY_DIR_PREFIX + "*", PROXY_SOCKET)
    return [path for path in glob.glob(pattern) if path != own]


def refresh_fleet(
    hosts: Sequence[tuple[str, int]], known: dict[tuple[str, int], list[IPAddress]]
) -> bool:
    """Resolve each fleet host into `known`; one that does not resolve keeps what it had.
    True when a lookup failed."""
    failed = False
    for host, port in hosts:
        found = resolve(host, port)
        if found:
            known[(host, port)] = found
        else:
            failed = True
    return failed


class _Server(socketserver.ThreadingUnixStreamServer):
    """A thread per connection, at most `MAX_CONNECTIONS` at once: a tool that opens
    connections without end is refused, not given the worker's threads."""

    daemon_threads = True
    proxy: EgressProxy
    slots = threading.BoundedSemaphore(1)  # replaced per server in `__init__`

    def __init__(self, path: str, handler: type[socketserver.BaseRequestHandler]) -> None:
        super().__init__(path, handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.active = 0
        self._count = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            log.warning("egress: %d connections open; one more refused", MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        with self._count:
            self.active += 1
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count:
                self.active -= 1
            self.slots.release()


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(HEAD_TIMEOUT_S)
        try:
            first = sock.recv(1, socket.MSG_PEEK)
            if first == b"\x05":
                upstream = socks5_request(sock, self.server.proxy.open)
            else:
                upstream = http_request(sock, self.server.proxy.open)
        except (OSError, ValueError):
            return
        if upstream is not None:
            splice(sock, upstream, self.server.proxy.idle_s, self.server.proxy.drain_s)
