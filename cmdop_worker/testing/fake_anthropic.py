"""A local fake of the Anthropic Messages API, for tests, benchmarks and the demo.

The real `anthropic` SDK reaches it through `base_url=` or `ANTHROPIC_BASE_URL`.
Owns the HTTP shell only: sockets, sleeps, ids, recordings, the fault queue and the
control API. What to answer is decided by the pure `fake_script` module, which also
documents the script and fault formats and the cache approximation.

Routes (query strings ignored):
    POST /v1/messages            JSON, or SSE when the body has "stream": true
    PUT  /_fake/scripts/<name>   a script (see fake_script)
    PUT  /_fake/default          {"script": name}
    POST /_fake/faults           one fault or a list, consumed FIFO by the next requests
    GET  /_fake/requests         the recordings of /v1/* requests
    POST /_fake/reset            clear faults, recordings and cache; keep scripts
    GET  /_fake/health

CLI: `python -m cmdop_worker.testing.fake_anthropic --port P [--script-file F]` prints
`http://127.0.0.1:P` once listening and serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import signal
import socket
import struct
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import ValidationError

from cmdop_worker.testing import fake_script as fs
from cmdop_worker.testing.fake_script import Fault, JsonDict, Script

log = logging.getLogger(__name__)
REDACTED_HEADERS = frozenset({"x-api-key", "authorization"})
# These faults answer before any model output exists, so they must not touch the cache.
_NO_OUTPUT = (fs.StatusFault, fs.ResetFault, fs.MalformedFault)


@dataclass
class _Answer:
    fault: Fault | None
    message: JsonDict | None
    delay_s: float
    token_delay_s: float


class _State:
    """Everything a server remembers; every method is safe to call from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.scripts: dict[str, Script] = dict(fs.BUILTIN_SCRIPTS)
        self.default = "default"
        self.faults: deque[list[Any]] = deque()  # [fault, uses left]
        self.turn_fault_uses: Counter[tuple[str, int]] = Counter()
        self.records: list[JsonDict] = []
        self.cache: set[str] = set()

    def add_script(self, name: str, script: Any) -> None:
        parsed = script if isinstance(script, Script) else Script.model_validate(script)
        with self.lock:
            self.scripts[name] = parsed

    def set_default(self, name: str) -> None:
        with self.lock:
            if name not in self.scripts:
                raise KeyError(f"unknown script {name!r}")
            self.default = name

    def health(self) -> JsonDict:
        with self.lock:
            return {"ok": True, "scripts": sorted(self.scripts), "default": self.default}

    def reset(self) -> None:
        with self.lock:
            self.faults.clear()
            self.turn_fault_uses.clear()
            self.records.clear()
            self.cache.clear()

    def inject(self, faults: list[Fault]) -> None:
        with self.lock:
            self.faults.extend([f, f.times] for f in faults)

    def _pop_fault(self) -> Fault | None:
        if not self.faults:
            return None
        entry = self.faults[0]
        entry[1] -= 1
        if entry[1] <= 0:
            self.faults.popleft()
        fault: Fault = entry[0]
        return fault

    def _turn_fault(self, name: str, index: int, fault: Fault | None) -> Fault | None:
        if fault is None or self.turn_fault_uses[name, index] >= fault.times:
            return None
        self.turn_fault_uses[name, index] += 1
        return fault

    def answer(self, body: JsonDict) -> _Answer:
        """Decide the response to a /v1/messages request (global faults first)."""
        with self.lock:
            fault = self._pop_fault()
            name, index = fs.script_name(body, self.default), fs.turn_index(body)
            script = self.scripts.get(name)
            if script is None:
                unknown = fs.StatusFault(status=400, message=f"fake: unknown script {name!r}")
                return _Answer(fault if isinstance(fault, _NO_OUTPUT) else unknown, None, 0, 0)
            turn = script.turn_for(index, str(body.get("model", "")))
            fault = fault or self._turn_fault(name, index, turn.fault)
            message = None
            if not isinstance(fault, _NO_OUTPUT):
                usage = fs.input_usage(fs.prefix_points(body), self.cache)
                self.cache.update(usage.written)
                blocks = fs.render_blocks(turn, body, lambda: f"toolu_{uuid.uuid4().hex[:20]}")
                msg_id = f"msg_{uuid.uuid4().hex[:24]}"
                message = fs.message_object(msg_id, str(body.get("model", "")), blocks, usage)
        delay_s = (script.latency_ms + turn.latency_ms) / 1000
        return _Answer(fault, message, delay_s, script.token_delay_ms / 1000)

    def record(
        self, method: str, path: str, headers: Iterable[tuple[str, str]], body: Any
    ) -> JsonDict:
        entry: JsonDict = {
            "method": method,
            "path": path,
            "headers": {
                k.lower(): "<redacted>" if k.lower() in REDACTED_HEADERS else v for k, v in headers
            },
            "body": body,
            "received_ms": time.monotonic() * 1000,
            "response": None,
        }
        with self.lock:
            self.records.append(entry)
        return entry

    def set_response(self, entry: JsonDict, answer: _Answer) -> None:
        response: JsonDict = {"fault": answer.fault.model_dump() if answer.fault else None}
        if answer.message is not None:
            keys = ("id", "content", "stop_reason", "usage")
            response.update({k: answer.message[k] for k in keys})
        with self.lock:
            entry["response"] = response

    def snapshot(self) -> list[JsonDict]:
        with self.lock:
            return copy.deepcopy(self.records)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: _State

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug(
            "fake anthropic: connection from %s ended abruptly", client_address, exc_info=True
        )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else Nagle + delayed ACK add ~40 ms per response
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("fake anthropic: " + format, *args)

    @property
    def _path(self) -> str:
        return urlsplit(self.path).path

    def _body(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else None

    def _send(
        self,
        status: int,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        cut: int | None = None,
    ) -> None:
        """Send a response; with `cut`, only that many bytes of the announced body."""
        self.send_response(status)
        for key, value in {"content-type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("request-id", f"req_{uuid.uuid4().hex[:24]}")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:cut])
        self.close_connection = self.close_connection or cut is not None

    def _send_json(self, status: int, value: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(value).encode(), headers)

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self.server.state.stopping.wait(seconds)

    # --- routing ------------------------------------------------------------------

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def _route(self, method: str) -> None:
        path, state = self._path, self.server.state
        if (method, path) == ("POST", "/v1/messages"):
            return self._messages()
        if method == "PUT" and path.startswith("/_fake/scripts/"):
            name = unquote(path.removeprefix("/_fake/scripts/"))
            return self._control(lambda body: state.add_script(name, body))
        controls: dict[tuple[str, str], Callable[[Any], Any]] = {
            ("GET", "/_fake/health"): lambda _: state.health(),
            ("GET", "/_fake/requests"): lambda _: state.snapshot(),
            ("POST", "/_fake/faults"): lambda body: state.inject(fs.parse_faults(body)),
            ("POST", "/_fake/reset"): lambda _: state.reset(),
            ("PUT", "/_fake/default"): lambda body: state.set_default(body["script"]),
        }
        if (method, path) in controls:
            return self._control(controls[method, path])
        if path.startswith("/v1/"):
            state.record(method, self.path, self.headers.items(), None)
        return self._send_json(404, fs.error_body(404, f"fake: no route {method} {path}"))

    def _control(self, apply: Callable[[Any], Any]) -> None:
        try:
            result = apply(self._body())
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            self._send_json(400, fs.error_body(400, f"fake: {exc}"))
        else:
            self._send_json(200, {"ok": True} if result is None else result)

    # --- the Messages API -----------------------------------------------------------

    def _messages(self) -> None:
        state = self.server.state
        try:
            body = self._body()
        except ValueError:
            body = None
        entry = state.record("POST", self.path, self.headers.items(), body)
        if not isinstance(body, dict):
            answer = _Answer(
                fs.StatusFault(status=400, message="fake: body is not a JSON object"), None, 0, 0
            )
        else:
            answer = state.answer(body)
        state.set_response(entry, answer)
        self._wait(answer.delay_s)
        stream = isinstance(body, dict) and body.get("stream") is True
        self._carry_out(answer, stream)

    def _carry_out(self, answer: _Answer, stream: bool) -> None:
        fault = answer.fault
        if isinstance(fault, fs.StatusFault):
            body = fs.error_body(fault.status, fault.message)
            self._send_json(fault.status, body, fs.retry_headers(fault))
        elif isinstance(fault, fs.ResetFault):
            self._reset_connection()
        elif isinstance(fault, fs.MalformedFault):
            self._send_malformed(stream)
        else:
            if isinstance(fault, fs.StallFault) and (fault.after_events is None or not stream):
                self._wait(fault.seconds)
            assert answer.message is not None
            if stream:
                self._send_stream(answer.message, fault, answer.token_delay_s)
            else:
                self._send_message(answer.message, fault)

    def _reset_connection(self) -> None:
        # Linger 0 makes close() send an RST instead of an orderly FIN.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _send_malformed(self, stream: bool) -> None:
        if not stream:
            self._send(200, b'{"id": "msg_malformed", "type": "message", "content": [')
            return
        self._start_stream(close=False)
        self._chunk(b'event: message_start\ndata: {"type": "message_start", "message": {\n\n')
        self._chunk(b"")

    def _send_message(self, message: JsonDict, fault: Fault | None) -> None:
        if isinstance(fault, fs.ErrorEventFault):
            self._send_json(529, fs.error_body(529, "Overloaded"))
        elif isinstance(fault, fs.TruncateFault):
            raw = json.dumps(message).encode()
            self._send(200, raw, cut=len(raw) // 2)
        else:
            self._send_json(200, message)

    # --- streaming ------------------------------------------------------------------

    def _start_stream(self, close: bool) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("request-id", f"req_{uuid.uuid4().hex[:24]}")
        self.send_header("transfer-encoding", "chunked")
        if close:
            self.send_header("connection", "close")
            self.close_connection = True
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        """One chunk of the chunked body; an empty one ends the body."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _send_stream(self, message: JsonDict, fault: Fault | None, token_delay_s: float) -> None:
        events = fs.sse_events(message)
        self._start_stream(close=isinstance(fault, fs.ErrorEventFault | fs.TruncateFault))
        for position, (name, data) in enumerate(events):
            if self._stream_fault(fault, position, len(events)):
                return
            self._chunk(fs.encode_sse(name, data))
            if name == "content_block_delta":
                self._wait(token_delay_s)
        if not self._stream_fault(fault, len(events), len(events)):
            self._chunk(b"")

    def _stream_fault(self, fault: Fault | None, position: int, count: int) -> bool:
        """Apply a fault due before event `position`; True when the stream ends here."""
        after = getattr(fault, "after_events", None)
        if after is None or min(after, count) != position:
            return False
        if isinstance(fault, fs.StallFault):
            self._wait(fault.seconds)
            return False
        if isinstance(fault, fs.ErrorEventFault):
            self._chunk(fs.encode_sse("error", fs.error_body(529, "Overloaded")))
            self._chunk(b"")
        # A truncated stream stops without the final empty chunk: the client sees an
        # incomplete body, not a clean end.
        return True


class FakeAnthropic:
    """A fake Messages API server on a daemon thread; also a context manager."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        scripts: Mapping[str, Script | Sequence[Any] | Mapping[str, Any]] | None = None,
        default_script: str = "default",
    ) -> None:
        self._address = (host, port)
        self._state = _State()
        for name, script in (scripts or {}).items():
            self.add_script(name, script)
        self.set_default(default_script)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FakeAnthropic:
        self._state.stopping.clear()
        server = _Server(self._address, _Handler)
        server.state = self._state
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.02},
            daemon=True,
            name="fake-anthropic",
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._state.stopping.set()  # wakes stalled handlers
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeAnthropic is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def add_script(self, name: str, script: Script | Sequence[Any] | Mapping[str, Any]) -> None:
        self._state.add_script(name, script)

    def set_default(self, name: str) -> None:
        self._state.set_default(name)

    def inject(self, *faults: Fault | Mapping[str, Any]) -> None:
        self._state.inject(fs.parse_faults(list(faults)))

    def requests(self) -> list[JsonDict]:
        """Recordings of /v1/* requests, oldest first (copies)."""
        return self._state.snapshot()

    def reset(self) -> None:
        self._state.reset()

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A local fake of the Anthropic Messages API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--script-file", type=Path, help='JSON: {"name": script, ...}')
    parser.add_argument("--default", default="default", help="the default script's name")
    args = parser.parse_args(argv)
    scripts = json.loads(args.script_file.read_text()) if args.script_file else {}
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with FakeAnthropic(
        host=args.host, port=args.port, scripts=scripts, default_script=args.default
    ) as fake:
        print(fake.url, flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
