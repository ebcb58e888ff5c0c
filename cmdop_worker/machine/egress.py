"""The worker's egress proxy: the only way out of a tool's network namespace.

One per machine worker, started when its policy gives tools network
(`MachineSide.egress`), listening on a unix socket that each sandbox gets bound in
(`sandbox.confined_argv`) and reaches through its bridge (`egress_bridge`). It speaks
HTTP CONNECT, plain-HTTP forwarding (`GET http://host/…`) and SOCKS5 (no auth,
CONNECT). For each request it resolves the destination itself, learns which of the
addresses are this machine's, asks `netpolicy.verdict`, and connects to exactly the
addresses it checked, never to a name resolved again (DNS rebinding). A refusal is a
403 whose body says why (SOCKS5: "not allowed by ruleset"), and a warning in the log.

The fleet's endpoints come from the worker's own settings (Redis, broker, result
backend, gateway URLs) and are resolved again every `FLEET_REFRESH_S`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import socketserver
import struct
import tempfile
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from cmdop_worker.machine.egress_bridge import splice
from cmdop_worker.machine.netpolicy import (
    Fleet,
    IPAddress,
    NetworkPolicy,
    Verdict,
    fleet_hosts,
    verdict,
)

log = logging.getLogger(__name__)

HEAD_MAX_BYTES = 65_536
HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
FLEET_REFRESH_S = 30.0
_HOP_HEADERS = (b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive")


class Refused(Exception):
    """The destination may not be reached (403), or could not be (502)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class EgressProxy:
    """The proxy's socket and threads. `decide` and `open` are its whole policy."""

    def __init__(self, policy: NetworkPolicy, fleet_urls: Sequence[str]) -> None:
        self.policy = policy
        self._fleet_urls = tuple(fleet_urls)
        self._fleet = Fleet()
        self._fleet_at = float("-inf")
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="cmdop-egress-")
        self.socket_path = os.path.join(self._dir, "egress.sock")
        self._server: socketserver.ThreadingUnixStreamServer | None = None

    def start(self) -> EgressProxy:
        server = _Server(self.socket_path, _Handler)
        server.proxy = self
        # A tool may run as another user (CMDOP_TOOL_USER): it must reach the socket.
        os.chmod(self._dir, 0o711)
        os.chmod(self.socket_path, 0o666)
        threading.Thread(target=server.serve_forever, name="egress", daemon=True).start()
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

    def fleet(self) -> Fleet:
        """The fleet's endpoints, resolved now and then (a host may move)."""
        with self._lock:
            if time.monotonic() - self._fleet_at > FLEET_REFRESH_S:
                self._fleet = resolved_fleet(self._fleet_urls)
                self._fleet_at = time.monotonic()
            return self._fleet

    def decide(self, host: str, port: int) -> Verdict:
        addresses = resolve(host, port)
        return verdict(host, port, addresses, local_of(addresses), self.policy, self.fleet())

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


def resolved_fleet(urls: Sequence[str]) -> Fleet:
    endpoints = {
        (address, port) for host, port in fleet_hosts(urls) for address in resolve(host, port)
    }
    return Fleet(frozenset(endpoints))


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    proxy: EgressProxy


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(HEAD_TIMEOUT_S)
        try:
            first = sock.recv(1, socket.MSG_PEEK)
            if first == b"\x05":
                upstream = _socks5(sock, self.server.proxy)
            else:
                upstream = _http(sock, self.server.proxy)
        except (OSError, ValueError):
            return
        if upstream is not None:
            sock.settimeout(None)
            splice(sock, upstream)


def _http(sock: socket.socket, proxy: EgressProxy) -> socket.socket | None:
    head, rest = _read_head(sock)
    lines = head.split(b"\r\n")
    try:
        method, target, version = lines[0].decode("latin-1").split(" ")
        host, port, path = _target(method, target)
    except ValueError as exc:
        _answer(sock, 400, f"bad proxy request: {exc}")
        return None
    try:
        upstream = proxy.open(host, port)
    except Refused as exc:
        _answer(sock, exc.status, f"cmdop egress: {exc}")
        return None
    if method == "CONNECT":
        sock.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            upstream.sendall(rest)
        return upstream
    kept = [
        line for line in lines[1:] if line.split(b":", 1)[0].strip().lower() not in _HOP_HEADERS
    ]
    request = f"{method} {path} {version}\r\n".encode("latin-1")
    upstream.sendall(request + b"\r\n".join([*kept, b"Connection: close", b"", b""]) + rest)
    return upstream


def _header_name(line: bytes) -> bytes:
    return line.split(b":", 1)[0].strip().lower()


def _target(method: str, target: str) -> tuple[str, int, str]:
    """Host, port and origin-form path of a CONNECT or absolute-URI request."""
    if method == "CONNECT":
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"CONNECT needs host:port, got {target!r}")
        return host.strip("[]"), int(port), ""
    url = urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"only http:// URLs are forwarded (use CONNECT for TLS): {target!r}")
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return url.hostname, url.port or 80, path


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > HEAD_MAX_BYTES:
            raise ValueError("request head too large")
        chunk = sock.recv(8192)
        if not chunk:
            raise ValueError("closed before the request head ended")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _answer(sock: socket.socket, status: int, text: str) -> None:
    phrase = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[status]
    body = (text + "\n").encode()
    sock.sendall(
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


def _socks5(sock: socket.socket, proxy: EgressProxy) -> socket.socket | None:
    """RFC 1928, no authentication, CONNECT only."""
    _, count = _exact(sock, 2)
    methods = _exact(sock, count)
    if 0 not in methods:
        sock.sendall(b"\x05\xff")
        return None
    sock.sendall(b"\x05\x00")
    _, command, _, kind = _exact(sock, 4)
    if kind == 1:
        host = str(ipaddress.IPv4Address(_exact(sock, 4)))
    elif kind == 4:
        host = str(ipaddress.IPv6Address(_exact(sock, 16)))
    elif kind == 3:
        host = _exact(sock, _exact(sock, 1)[0]).decode("idna")
    else:
        raise ValueError(f"unknown SOCKS address type {kind}")
    (port,) = struct.unpack("!H", _exact(sock, 2))
    if command != 1:
        sock.sendall(_socks_reply(7))
        return None
    try:
        upstream = proxy.open(host, port)
    except Refused as exc:
        sock.sendall(_socks_reply(2 if exc.status == 403 else 4))
        return None
    sock.sendall(_socks_reply(0))
    return upstream


def _socks_reply(code: int) -> bytes:
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


def _exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ValueError("closed mid-request")
        data += chunk
    return data
