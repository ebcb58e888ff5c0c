"""What the fake Anthropic server knows: scripts, the fault queue, the cache, recordings.

Shared by every connection of the HTTP shell (`fake_http`) behind one lock. `answer`
decides the response to a request (a 400 for a request the API refuses, as
`fake_rules` checks it; then faults; then a 429 beyond the rate limits, `fake_limits`;
then the script's turn), with the rate-limit headers every answer carries; the rest
is bookkeeping the control API exposes.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cmdop_worker.testing import fake_limits as fl
from cmdop_worker.testing import fake_rules
from cmdop_worker.testing import fake_script as fs
from cmdop_worker.testing import fake_wire as fw
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
    headers: dict[str, str] = field(default_factory=dict)  # the rate-limit headers
    pace_tps: float = 0.0  # output tokens per second (`fake_wire` pacing); 0: unpaced


class _State:
    """Everything a server remembers; every method is safe to call from any thread."""

    def __init__(self, pace_tps: float = 0.0) -> None:
        self.pace_tps = pace_tps  # for scripts and turns that set none
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.scripts: dict[str, Script] = dict(fs.BUILTIN_SCRIPTS)
        self.default = "default"
        self.faults: deque[list[Any]] = deque()  # [fault, uses left]
        self.turn_fault_uses: Counter[tuple[str, int]] = Counter()
        self.records: list[JsonDict] = []
        self.cache: set[str] = set()
        self.limits = fl.Buckets()

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
            self.limits.reset()  # the default limits, every bucket full

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
        refused = fake_rules.request_problem(body)
        if refused is not None:  # the API checks a request before anything else
            return _Answer(fs.StatusFault(status=400, message=refused), None, 0, 0)
        with self.lock:
            fault = self._pop_fault()
            name, index = fs.script_turn(body, self.default)
            script = self.scripts.get(name)
            if script is None:
                unknown = fs.StatusFault(status=400, message=f"fake: unknown script {name!r}")
                return _Answer(fault if isinstance(fault, _NO_OUTPUT) else unknown, None, 0, 0)
            turn = script.turn_for(index, str(body.get("model", "")))
            fault = fault or self._rate_limited(body) or self._turn_fault(name, index, turn.fault)
            message = None
            if not isinstance(fault, _NO_OUTPUT):
                usage = fw.input_usage(fw.prefix_points(body), self.cache)
                self.cache.update(usage.written)
                blocks = fs.render_blocks(turn, body, lambda: f"toolu_{uuid.uuid4().hex[:20]}")
                msg_id = f"msg_{uuid.uuid4().hex[:24]}"
                message = fw.message_object(msg_id, str(body.get("model", "")), blocks, usage)
                message["stop_reason"] = turn.stop_reason or message["stop_reason"]
            headers = self._limit_headers(str(body.get("model", "")), message)
        delay_s = (script.latency_ms + turn.latency_ms) / 1000
        pace_tps = script.pace_for(turn, self.pace_tps)
        return _Answer(fault, message, delay_s, script.token_delay_ms / 1000, headers, pace_tps)

    def set_rate_limit(self, spec: Any) -> JsonDict:
        """New limits (None: the defaults), every bucket full again."""
        limit = fl.RateLimit.model_validate(spec) if spec is not None else fl.RateLimit()
        with self.lock:
            self.limits.reset(limit)
        return limit.model_dump()

    def _rate_limited(self, body: JsonDict) -> fs.StatusFault | None:
        model, now_s = str(body.get("model", "")), time.monotonic()
        refusal = self.limits.admit(model, input_tokens=fl.input_tokens_of(body), now_s=now_s)
        if refusal is None:
            return None
        return fs.StatusFault(
            status=429, retry_after_s=refusal.retry_after_s, message=refusal.message
        )

    def _limit_headers(self, model: str, message: JsonDict | None) -> dict[str, str]:
        now_s = time.monotonic()
        if message is not None:
            self.limits.take_output(model, int(message["usage"]["output_tokens"]), now_s)
        return self.limits.headers(model, now_s=now_s, now_unix_s=time.time())

    def record(
        self, method: str, path: str, headers: Iterable[tuple[str, str]], body: Any
    ) -> JsonDict:
        entry: JsonDict = {
            "method": method,
            "path": path,
            "headers": {
                k.lower(): "<redacted>" if k.lower() in REDACTED_HEADERS else v for k, v in headers
            },
            # A body that is no JSON object (cut short by a sender killed mid-request,
            # or malformed) is recorded empty, so readers of `body` need no None check.
            "body": body if isinstance(body, dict) else {},
            "malformed": not isinstance(body, dict),
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
