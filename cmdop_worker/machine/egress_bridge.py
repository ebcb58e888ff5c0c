"""The bridge inside a tool's network namespace: 127.0.0.1:PORT there leads to the
worker's egress proxy, through the proxy's unix socket bound into the sandbox.

A sandboxed command with network runs as `python -I -S -c <this file> PORT SOCKET --
COMMAND…`: the bridge binds its port, forks a server that carries each connection to
the socket, and execs the command in its own place (its pid, its exit code). The
namespace has no other route out, so the proxy decides every destination. The server
dies with the sandbox's PID namespace when the command ends.

Standard library only, and nothing of the package: it runs from its source, under the
system's interpreter, with neither the package nor its virtualenv visible. It takes the
C modules (`_socket`, `_thread`) rather than `socket` and `threading`, whose imports
would more than double what a call with network pays to start it. `splice` is also the proxy's
(`egress`).
"""

from __future__ import annotations

import _socket
import _thread
import os
import select
import sys
import time

CHUNK = 65_536
# A connection outlives no call by much: with no byte either way for IDLE_S it ends,
# and once one side has ended, the other has DRAIN_S to finish (a server that never
# closes would otherwise hold one of the proxy's connections for good).
IDLE_S = 300.0
DRAIN_S = 30.0


def splice(
    a: _socket.socket, b: _socket.socket, idle_s: float = IDLE_S, drain_s: float = DRAIN_S
) -> None:
    """Carry bytes both ways until both sides are done; a side's end of data is passed
    on as a half-close, so a request-then-response exchange completes."""
    open_ = {a: b, b: a}
    until = float("inf")  # set when the first side ends
    try:
        a.settimeout(idle_s)  # a send to a side that never reads ends too
        b.settimeout(idle_s)
        while open_:
            wait = min(idle_s, until - time.monotonic())
            ready, _, _ = select.select(list(open_), [], [], max(wait, 0.0))
            if not ready:
                return
            for src in ready:
                data = src.recv(CHUNK)
                if data:
                    open_[src].sendall(data)
                    continue
                _half_close(open_.pop(src))
                until = min(until, time.monotonic() + drain_s)
    except OSError:
        pass  # a reset on either side ends the exchange
    finally:
        a.close()
        b.close()


def _half_close(sock: _socket.socket) -> None:
    try:  # noqa: SIM105  (importing contextlib would slow the bridge's start)
        sock.shutdown(_socket.SHUT_WR)
    except OSError:
        pass


def _serve(listener: _socket.socket, path: str) -> None:
    while True:
        # `_socket` has no accept(): `socket.socket.accept` wraps this one.
        fd, _ = listener._accept()  # type: ignore[attr-defined]
        client = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM, 0, fd)
        _thread.start_new_thread(_carry, (client, path))


def _carry(client: _socket.socket, path: str) -> None:
    upstream = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    splice(client, upstream)


def _quiet() -> None:
    """The server holds none of the command's pipes: the worker reads them to their end."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)


def main(argv: list[str]) -> None:
    port, path, dashes, *command = argv
    if dashes != "--" or not command:
        sys.exit("usage: egress_bridge PORT SOCKET -- COMMAND...")
    listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(port)))
    listener.listen(128)
    if os.fork() == 0:
        try:
            _quiet()
            _serve(listener, path)
        finally:
            os._exit(0)
    listener.close()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.exit(f"{command[0]}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1:])
