"""The fake Anthropic server's HTTP shell: routes, JSON and SSE responses, faults.

One `_Handler` per connection; it asks the shared `_State` what to answer and carries
it out on the wire, including the faults that only a socket can produce (a stall, a
cut stream, a reset).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import ValidationError

from cmdop_worker.testing import fake_script as fs
from cmdop_worker.testing import fake_wire as fw
from cmdop_worker.testing.fake_script import Fault, JsonDict
from cmdop_worker.testing.fake_state import _Answer, _State

log = logging.getLogger(__name__)


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
    answer_headers: Mapping[str, str] = {}  # the current answer's rate-limit headers

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
        every = {"content-type": "application/json", **self.answer_headers, **(headers or {})}
        for key, value in every.items():
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
            ("PUT", "/_fake/rate_limit"): state.set_rate_limit,
        }
        if (method, path) in controls:
            return self._control(controls[method, path])
        if path.startswith("/v1/"):
            state.record(method, self.path, self.headers.items(), None)
        return self._send_json(404, fw.error_body(404, f"fake: no route {method} {path}"))

    def _control(self, apply: Callable[[Any], Any]) -> None:
        try:
            result = apply(self._body())
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            self._send_json(400, fw.error_body(400, f"fake: {exc}"))
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
        self.answer_headers = answer.headers
        try:
            self._carry_out(answer, stream)
        finally:
            self.answer_headers = {}

    def _carry_out(self, answer: _Answer, stream: bool) -> None:
        fault = answer.fault
        if isinstance(fault, fs.StatusFault):
            body = fw.error_body(fault.status, fault.message)
            self._send_json(fault.status, body, fw.retry_headers(fault))
        elif isinstance(fault, fs.ResetFault):
            self._reset_connection()
        elif isinstance(fault, fs.MalformedFault):
            self._send_malformed(stream)
        else:
            if isinstance(fault, fs.StallFault) and (fault.after_events is None or not stream):
                self._wait(fault.seconds)
            assert answer.message is not None
            if stream:
                self._send_stream(answer.message, fault, answer.token_delay_s, answer.pace_tps)
            else:
                self._send_message(answer.message, fault, answer.pace_tps)

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

    def _send_message(self, message: JsonDict, fault: Fault | None, pace_tps: float) -> None:
        if isinstance(fault, fs.ErrorEventFault):
            self._send_json(529, fw.error_body(529, "Overloaded"))
            return
        self._wait(fw.reply_seconds(message, pace_tps))  # the model writes all of it first
        if isinstance(fault, fs.TruncateFault):
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
        for key, value in self.answer_headers.items():
            self.send_header(key, value)
        self.send_header("transfer-encoding", "chunked")
        if close:
            self.send_header("connection", "close")
            self.close_connection = True
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        """One chunk of the chunked body; an empty one ends the body."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _send_stream(
        self, message: JsonDict, fault: Fault | None, token_delay_s: float, pace_tps: float
    ) -> None:
        events = fw.sse_events(message, paced=pace_tps > 0)
        delays = fw.stream_delays(events, pace_tps, token_delay_s)
        self._start_stream(close=isinstance(fault, fs.ErrorEventFault | fs.TruncateFault))
        for position, ((name, data), delay_s) in enumerate(zip(events, delays, strict=True)):
            self._wait(delay_s)
            if self._stream_fault(fault, position, len(events)):
                return
            self._chunk(fw.encode_sse(name, data))
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
            self._chunk(fw.encode_sse("error", fw.error_body(529, "Overloaded")))
            self._chunk(b"")
        # A truncated stream stops without the final empty chunk: the client sees an
        # incomplete body, not a clean end.
        return True
