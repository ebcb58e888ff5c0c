"""Traces from real worker processes, received over OTLP/HTTP by a receiver on loopback.

Each test runs a fleet of its own (a coordinator, machines `alpha` and `beta`) on its
own redis-server, sharing only the session's fake model, and a tiny OTLP receiver that
decodes every POST /v1/traces into spans.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from cmdop_worker.config import Settings
from cmdop_worker.models import RunResult
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.tracing import run_span_context

pytestmark = pytest.mark.integration

MACHINES = ("alpha", "beta")


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: list[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class Receiver:
    """An OTLP/HTTP trace receiver (protobuf) on 127.0.0.1."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(self.path, ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, path: str, request: ExportTraceServiceRequest) -> None:
        assert path == "/v1/traces", path
        spans = [
            Span(
                name=span.name,
                trace_id=span.trace_id.hex(),
                span_id=span.span_id.hex(),
                parent_id=span.parent_span_id.hex(),
                attributes=_attributes(list(span.attributes)),
                resource=_attributes(list(batch.resource.attributes)),
            )
            for batch in request.resource_spans
            for scope in batch.scope_spans
            for span in scope.spans
        ]
        with self.lock:
            self.posts += 1
            self.spans.extend(spans)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.close()


@dataclass
class Ran:
    result: RunResult
    usage: list[dict[str, int]]  # the fake model's, per request


def run_two_turns(
    fleet_env: dict[str, str], env: dict[str, str], script: Any, logdir: Path, **fields: Any
) -> Ran:
    """One run on a fleet of its own: turn 1 calls a tool on each machine, turn 2 reports."""
    server = RedisServer().start()
    local = LocalFleet({**fleet_env, "CMDOP_REDIS_URL": server.url, **env}, logdir=logdir)
    calls = [
        {"type": "tool_use", "name": "execute_command", "input": {"machine": m, "command": "true"}}
        for m in MACHINES
    ]
    prompt = script(
        [[{"type": "text", "text": "on both"}, *calls], [{"type": "text", "text": "ok"}]]
    )
    try:
        local.start_coordinator()
        for machine in MACHINES:
            local.start_machine(machine)
        local.wait_ready(MACHINES, timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            result = client.submit(prompt=prompt, **fields).wait(timeout=30)
    finally:
        local.stop()  # a worker that stops sends what it still holds
        server.stop()
    usage = [rec["response"]["usage"] for rec in script.requests_for(prompt)]
    return Ran(result, usage)


def wait_for_spans(receiver: Receiver, count: int, timeout_s: float = 15.0) -> list[Span]:
    give_up = time.monotonic() + timeout_s
    while len(spans := receiver.snapshot()) < count and time.monotonic() < give_up:
        time.sleep(0.05)
    return spans


# In parallel the coordinator publishes both tool calls; in sequence (a chain) the
# machine that ran the first publishes the second: its traceparent must come along.
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_a_run_is_one_trace_rooted_at_its_agent_span(
    fleet_env, script, receiver, tmp_path, monkeypatch, parallel
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    ran = run_two_turns(fleet_env, env, script, tmp_path, parallel_tools=parallel)
    assert ran.result.status == "done"
    # The run, two turns, two model calls, two tool calls.
    spans = wait_for_spans(receiver, 7)
    names = sorted(s.name for s in spans)
    model = {s.attributes["gen_ai.request.model"] for s in spans if s.name.startswith("chat ")}
    assert len(model) == 1, names
    assert names == sorted(
        [
            "invoke_agent operator",
            *["cmdop.turn"] * 2,
            *[f"chat {model.pop()}"] * 2,
            *["execute_tool execute_command"] * 2,
        ]
    ), names

    expected = run_span_context(ran.result.run_id)
    assert {s.trace_id for s in spans} == {f"{expected.trace_id:032x}"}
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)
    (root,) = [s for s in spans if not s.parent_id]
    assert root.name == "invoke_agent operator"
    assert root.span_id == f"{expected.span_id:016x}"
    assert root.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert root.attributes["gen_ai.agent.name"] == "operator"
    assert root.attributes["gen_ai.conversation.id"] == ran.result.run_id
    for span in spans:  # one tree: every parent is in the trace, up to the root
        seen, node = set(), span
        while node.parent_id:
            assert node.parent_id in by_id, f"{node.name}: parent {node.parent_id} not sent"
            assert node.span_id not in seen
            seen.add(node.span_id)
            node = by_id[node.parent_id]
        assert node is root

    turns = {s.attributes["cmdop.turn"]: s for s in spans if s.name == "cmdop.turn"}
    assert sorted(turns) == [1, 2]
    assert all(t.parent_id == root.span_id for t in turns.values())
    assert all(t.resource["cmdop.role"] == "coordinator" for t in turns.values())
    assert all(s.resource["service.name"] == "cmdop-worker" for s in spans)

    chats = [s for s in spans if s.name.startswith("chat ")]
    chat_by_turn = {by_id[s.parent_id].attributes["cmdop.turn"]: s for s in chats}
    assert sorted(chat_by_turn) == [1, 2]
    assert len(ran.usage) == 2
    for turn, usage in enumerate(ran.usage, start=1):
        attrs = chat_by_turn[turn].attributes
        cached = usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.provider.name"] == "anthropic"
        assert attrs["gen_ai.usage.input_tokens"] == usage["input_tokens"] + cached
        assert attrs["gen_ai.usage.output_tokens"] == usage["output_tokens"]
        assert attrs["gen_ai.usage.cache_read.input_tokens"] == usage["cache_read_input_tokens"]
        assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"]
        assert attrs["gen_ai.conversation.id"] == ran.result.run_id
    totals = ran.result.usage
    assert root.attributes["gen_ai.usage.output_tokens"] == totals.output_tokens

    asked = {
        block["id"]: block["input"]["machine"]
        for message in ran.result.messages
        if message.role == "assistant" and isinstance(message.content, list)
        for block in message.content
        if block.get("type") == "tool_use"
    }
    tools = [s for s in spans if s.name.startswith("execute_tool")]
    assert {s.attributes["gen_ai.tool.call.id"]: s.attributes["cmdop.machine"] for s in tools} == (
        asked
    )
    for span in tools:
        assert span.parent_id == turns[1].span_id  # via the message's traceparent
        assert span.attributes["gen_ai.tool.name"] == "execute_command"
        assert span.attributes["gen_ai.operation.name"] == "execute_tool"
        assert span.resource["cmdop.role"] == "machine"
        assert span.resource["cmdop.machine"] == span.attributes["cmdop.machine"]


def test_without_an_otlp_endpoint_nothing_is_sent(
    fleet_env, script, receiver, tmp_path, monkeypatch
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    # Any exporter built on the SDK's defaults would follow these two; none may exist.
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver.url}/v1/traces",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    ran = run_two_turns(fleet_env, env, script, tmp_path)
    assert ran.result.status == "done"
    assert wait_for_spans(receiver, 1, timeout_s=1.0) == []
    assert receiver.posts == 0
