"""The gateway as tests meet it: a real `cmdop-worker gateway` process (uvicorn) on a
free port, and plain HTTP and SSE clients (http.client) that see exactly what goes
over the wire — status, headers, every `id:` and `data:` line."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cmdop_worker.surfaces.fleet import free_port

CLI = str(Path(sys.executable).with_name("cmdop-worker"))


@dataclass
class GatewayProcess:
    env: dict[str, str]
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    log: Path | None = None

    def start(self, timeout_s: float = 30) -> GatewayProcess:
        argv = [CLI, "gateway", "--host", self.host, "--port", str(self.port)]
        out = self.log.open("ab") if self.log else None
        try:
            self.process = subprocess.Popen(
                argv,
                env={**os.environ, **self.env},
                stdout=out or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()  # the child has its own copy
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if self.process.poll() is not None:
                raise AssertionError(f"the gateway exited {self.process.returncode}: {self.logs()}")
            try:
                if call(self.url, "GET", "/healthz").status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"the gateway did not answer /healthz within {timeout_s} s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: Any


def _connection(url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)


def call(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    token: str | None = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30,
) -> Reply:
    """One request; the body is JSON (or `raw` bytes as they are)."""
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    data = raw
    if body is not None:
        data = json.dumps(body).encode()
        sent.setdefault("Content-Type", "application/json")
    conn = _connection(url, timeout_s)
    try:
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        payload = response.read()
        found = {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()
    kind = found.get("content-type", "")
    parsed: Any = json.loads(payload) if payload and "json" in kind else payload
    return Reply(response.status, found, parsed)


@dataclass
class SseRead:
    status: int
    ids: list[int]  # each event's `id:` line
    events: list[dict[str, Any]]  # each event's `data:`, parsed
    closed_by_server: bool  # the stream ended on its own (not cut by the reader)


def read_sse(
    url: str,
    path: str,
    *,
    token: str | None = None,
    last_event_id: int | None = None,
    stop_after: int | None = None,
    timeout_s: float = 60,
) -> SseRead:
    """Read an event stream until the server closes it, or drop the connection after
    `stop_after` events, mid-stream, as a flaky network would."""
    headers = {"Accept": "text/event-stream"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    conn = _connection(url, timeout_s)
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    read = SseRead(response.status, [], [], closed_by_server=False)
    if response.status != 200:
        response.read()
        conn.close()
        return read
    block: dict[str, str] = {}
    try:
        while True:
            line = response.readline()
            if not line:
                read.closed_by_server = True
                return read
            text = line.decode().rstrip("\r\n")
            if text:
                name, _, value = text.partition(":")
                block[name] = block.get(name, "") + value.removeprefix(" ")
                continue
            if "data" in block:
                read.ids.append(int(block["id"]))
                read.events.append(json.loads(block["data"]))
                if stop_after is not None and len(read.events) >= stop_after:
                    return read
            block = {}
    finally:
        if conn.sock is not None:
            conn.sock.close()  # abruptly: no more is read from it
        conn.close()
