"""Where a port listens, read from the kernel (`/proc/net/tcp`, `/proc/net/tcp6`), and
this host's own non-loopback address, if it has one: to check that a server we start
is reachable from this host only."""

from __future__ import annotations

import base64
import ipaddress
import socket
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LISTEN = "0A"


def listening_addresses(port: int) -> list[IPAddress]:
    """The local addresses that TCP sockets listen on at `port`, in this network
    namespace (0.0.0.0 or :: for every interface)."""
    found: list[IPAddress] = []
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            fields = row.split()
            address, _, port_hex = fields[1].partition(":")
            if fields[3] == _LISTEN and int(port_hex, 16) == port:
                found.append(_address(address))
    return found


def _address(hex_address: str) -> IPAddress:
    # The kernel prints each 32-bit word of the address in host (little-endian) order.
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    return ipaddress.ip_address(b"".join(words))


def own_public_address() -> str | None:
    """An address of this host other than loopback (the one its default route uses),
    or None when it has none. A UDP `connect` sends nothing; it only picks a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if ipaddress.ip_address(address).is_loopback else address


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def http_status(url: str, auth: str | None = None) -> int:
    """The HTTP status `url` answers with (basic `auth` as "user:password" if given);
    0 when nothing answers (a server still starting)."""
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", f"Basic {base64.b64encode(auth.encode()).decode()}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except OSError:
        return 0


def page_handler(body: str) -> type[BaseHTTPRequestHandler]:
    """A request handler that answers every GET with `body`, quietly."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_: object) -> None:
            pass

    return Page
