"""The egress proxy on its real unix socket, in this process: what it answers, what it
forwards, and what it never resolves. A local web server counts what reaches it."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from cmdop_worker.machine import egress, egress_wire
from cmdop_worker.machine.egress import EgressProxy
from cmdop_worker.machine.netpolicy import parse_network
from tests.procs import wait_for

BODY = b"local-page-7d1e"


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def page() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def proxy_for(network: object, fleet: list[str] | None = None) -> EgressProxy:
    return EgressProxy(parse_network(network), fleet or []).start()


def ask(proxy: EgressProxy, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(proxy.socket_path)
        sock.sendall(request)
        return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_listed_local_page_is_forwarded_and_connect_tunnels(page: ThreadingHTTPServer) -> None:
    port = page.server_address[1]
    proxy = proxy_for([f"127.0.0.1:{port}"])
    try:
        got = ask(proxy, f"GET http://127.0.0.1:{port}/x HTTP/1.1\r\nHost: a\r\n\r\n".encode())
        assert got.startswith(b"HTTP/1.0 200") and got.endswith(BODY)
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(proxy.socket_path)
            sock.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert read_all(sock).endswith(BODY)
    finally:
        proxy.stop()


def test_any_refuses_loopback_with_the_reason_in_the_body(page: ThreadingHTTPServer) -> None:
    port = page.server_address[1]
    proxy = proxy_for("any", [f"redis://127.0.0.1:{port + 1}"])
    try:
        for target in (f"127.0.0.1:{port}", f"localhost:{port}", f"0x7f000001:{port}"):
            got = ask(proxy, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
            assert got.startswith(b"HTTP/1.1 403 Forbidden"), got
            assert b"loopback" in got
        fleet = ask(proxy, f"CONNECT [::1]:{port + 1} HTTP/1.1\r\n\r\n".encode())
        assert b"fleet's own Redis" in fleet
    finally:
        proxy.stop()


def test_socks5_refuses_with_not_allowed(page: ThreadingHTTPServer) -> None:
    proxy = proxy_for("any")
    try:
        name = b"localhost"
        request = b"\x05\x01\x00" + b"\x05\x01\x00\x03" + bytes([len(name)]) + name
        got = ask(proxy, request + struct.pack("!H", page.server_address[1]))
        assert got == b"\x05\x00" + bytes([5, 2, 0, 1, 0, 0, 0, 0, 0, 0])
    finally:
        proxy.stop()


def test_a_name_no_entry_covers_is_never_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[str] = []
    real = egress.resolve

    def recording(host: str, port: int) -> Any:
        looked_up.append(host)
        return real(host, port)

    monkeypatch.setattr(egress, "resolve", recording)
    proxy = proxy_for(["pypi.org:443", "*.debian.org"])
    try:
        got = ask(proxy, b"CONNECT secret-data.attacker.example:443 HTTP/1.1\r\n\r\n")
        assert b"not in the policy's network list" in got
        other_port = ask(proxy, b"CONNECT pypi.org:80 HTTP/1.1\r\n\r\n")
        assert other_port.startswith(b"HTTP/1.1 403")
        assert looked_up == []
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    "request_line",
    [b"CONNECT nohost HTTP/1.1", b"GET https://x/ HTTP/1.1", b"GET / HTTP/1.1", b"BREW"],
)
def test_a_malformed_request_is_a_400(request_line: bytes) -> None:
    proxy = proxy_for("any")
    try:
        assert ask(proxy, request_line + b"\r\n\r\n").startswith(b"HTTP/1.1 400")
    finally:
        proxy.stop()


def test_stop_removes_the_socket() -> None:
    proxy = proxy_for("any")
    proxy.stop()
    with socket.socket(socket.AF_UNIX) as sock, pytest.raises(OSError):
        sock.connect(proxy.socket_path)


@pytest.mark.parametrize(
    "target", ["127.0.0.1:71915", "127.0.0.1:0", "127.0.0.1:²", "h:-1", "h:000006379", "h:"]
)
def test_a_connect_port_outside_1_to_65535_is_refused_not_wrapped(target: str) -> None:
    with pytest.raises(ValueError, match=r"not a TCP port|needs host:port"):
        egress_wire._target("CONNECT", target)


def test_an_absolute_uri_port_is_read_as_written() -> None:
    assert egress_wire._target("GET", "http://u@[::1]:8080/x?y") == ("::1", 8080, "/x?y")
    assert egress_wire._target("GET", "http://h/") == ("h", 80, "/")
    with pytest.raises(ValueError):
        egress_wire._target("GET", "http://h:71915/")


@pytest.fixture
def silent() -> Iterator[socket.socket]:
    """A server that accepts, and then neither sends nor closes."""
    held: list[socket.socket] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def hold() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])

    threading.Thread(target=hold, daemon=True).start()
    yield listener
    listener.close()
    for sock in held:
        sock.close()


def tunnel(proxy: EgressProxy, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(proxy.socket_path)
    sock.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    assert sock.recv(100).startswith(b"HTTP/1.1 200")
    return sock


def test_a_server_that_never_closes_does_not_hold_the_connection(silent: socket.socket) -> None:
    port = silent.getsockname()[1]
    proxy = EgressProxy(parse_network([f"127.0.0.1:{port}"]), [], drain_s=0.2).start()
    try:
        tunnel(proxy, port).close()  # the tool is done; the server never will be
        wait_for(lambda: proxy.connections == 0, 10, "the proxy to let the connection go")
    finally:
        proxy.stop()


def test_a_silent_connection_ends_when_idle(silent: socket.socket) -> None:
    port = silent.getsockname()[1]
    proxy = EgressProxy(parse_network([f"127.0.0.1:{port}"]), [], idle_s=0.2).start()
    try:
        with tunnel(proxy, port) as sock:
            assert read_all(sock) == b""  # closed by the proxy, not by either side
        wait_for(lambda: proxy.connections == 0, 10, "the proxy to let the connection go")
    finally:
        proxy.stop()


def test_the_fleet_stays_refused_when_its_name_stops_resolving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = {"fleet.test": [ipaddress.ip_address("10.20.30.40")]}
    real = egress.resolve

    def flaky(host: str, port: int) -> Any:
        if host == "fleet.test":
            return answers.pop(host, [])  # resolves once, then fails
        return real(host, port)

    monkeypatch.setattr(egress, "resolve", flaky)
    monkeypatch.setattr(egress, "FLEET_REFRESH_S", -1.0)  # resolve again at every request
    proxy = EgressProxy(parse_network("any"), ["redis://fleet.test:6379"])
    try:
        for _ in range(3):
            decided = proxy.decide("10.20.30.40", 6379)
            assert not decided.allowed and "fleet" in decided.reason, decided
    finally:
        proxy.stop()


def test_no_egress_until_the_fleet_has_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(egress, "resolve", lambda host, port: [])
    proxy = EgressProxy(parse_network("any"), ["redis://fleet.test:6379"])
    try:
        decided = proxy.decide("93.184.216.34", 443)
        assert not decided.allowed
        assert "the fleet's fleet.test:6379 does not resolve" in decided.reason
    finally:
        proxy.stop()
