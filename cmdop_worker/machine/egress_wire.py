"""The egress proxy's two ways of being asked: an HTTP proxy request (CONNECT, or a
plain `GET http://host/…` forwarded in origin form) and a SOCKS5 CONNECT (RFC 1928, no
authentication). Each reads one request from a tool's connection, asks `open_` for
the upstream connection (which decides, `egress.EgressProxy.open`), and answers: the
tunnel is open, or why not (a 403 body; SOCKS5 "not allowed by ruleset"). The caller
splices the two sockets afterwards.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Callable
from urllib.parse import urlsplit

HEAD_MAX_BYTES = 65_536
_HOP_HEADERS = (b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive")


class Refused(Exception):
    """The destination may not be reached (403), or could not be (502)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


Opener = Callable[[str, int], socket.socket]


def http_request(sock: socket.socket, open_: Opener) -> socket.socket | None:
    head, rest = _read_head(sock)
    lines = head.split(b"\r\n")
    try:
        method, target, version = lines[0].decode("latin-1").split(" ")
        host, port, path = _target(method, target)
    except ValueError as exc:
        _answer(sock, 400, f"bad proxy request: {exc}")
        return None
    try:
        upstream = open_(host, port)
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
        if not sep or not host:
            raise ValueError(f"CONNECT needs host:port, got {target!r}")
        return host.strip("[]"), tcp_port(port), ""
    url = urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"only http:// URLs are forwarded (use CONNECT for TLS): {target!r}")
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    _, _, port = url.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")
    return url.hostname, tcp_port(port) if port else 80, path


def tcp_port(text: str) -> int:
    """A port as written: 1 to 5 ASCII digits, 1-65535. Anything else is refused, not
    wrapped: the socket layer would take 6379 + 65536 as 6379."""
    if not (text.isascii() and text.isdigit() and len(text) <= 5) or not 0 < int(text) < 65536:
        raise ValueError(f"not a TCP port (1-65535): {text!r}")
    return int(text)


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


def socks5_request(sock: socket.socket, open_: Opener) -> socket.socket | None:
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
        upstream = open_(host, port)
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
