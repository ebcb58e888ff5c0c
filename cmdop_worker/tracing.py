"""Traces: OpenTelemetry spans of every run, named by the GenAI semantic conventions.

A run is one trace, though it lives in many Celery tasks on many workers for minutes,
so no span object stays open across them:

    invoke_agent <agent>          the run: emitted once, when it ends (`emit_run_span`)
      ├─ cmdop.turn               one per `cmdop.turn` executed, parented on the run
      │    ├─ chat <model>        the turn's model call, our retries included, with usage
      │    └─ execute_tool <tool> on its machine, parented on the turn that sent it
      └─ cmdop.turn ...

How the pieces find each other without shared memory:

- The run's trace id and the run span's span id are the first 24 bytes of
  sha256(run id) (`run_span_context`), so every process knows them from the run id
  alone, and a turn span names the run span as its parent long before that span is
  built. The run span itself is built by the SDK's own tracer when the run ends, as a
  root (an empty context) with the run's `started_ms` as its start time; the
  provider's `IdGenerator` (`_run_ids`) hands it the two derived ids — and only it:
  every other span gets random ones.
- A tool span's parent, its turn span, travels in the `cmdop.tool` message's headers as
  a W3C `traceparent` (`trace_headers` when publishing, `tool_span` when running); a
  message without one parents the tool span on the run.
- opentelemetry-instrumentation-celery is not used: it parents each task on whoever
  published it, so turn n+1 would hang under the tool task that completed turn n, a
  chain as deep as the run, and it adds a publish and a run span per task.

Set up once per worker process (`lifecycle`, at worker init) only when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set: a tracer provider (service.name `cmdop-worker`,
`cmdop.role` coordinator or machine, `cmdop.machine`) exporting in batches over
OTLP/HTTP to `<endpoint>/v1/traces`; the SDK's other OTEL_EXPORTER_OTLP_* and OTEL_BSP_*
variables apply as documented by OpenTelemetry. Unset, nothing is installed and each
helper here returns at its first line.

Limits: until a run ends its spans have a parent no viewer has seen yet, and a run whose
coordinator dies while ending it may send its run span twice (same ids) or never. A
run id used again is the same trace id. The anthropic SDK's own spans are off
(`llm.client`): they would be a second chat span for each call, counting its tokens
twice. Called by the tasks, `llm.traced`, `coordinator.calls` and `coordinator.finish`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, SpanKind, StatusCode, TraceFlags

from cmdop_worker.errors import StopNow

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    from cmdop_worker.config import Settings
    from cmdop_worker.core.step import ModelReply
    from cmdop_worker.models import RunResult, ToolCall, Usage
    from cmdop_worker.state.store import RunState

SERVICE_NAME = "cmdop-worker"
PROVIDER = "anthropic"

_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None
# The ids the next span started in this context takes (the run span's), if any.
_FIXED: ContextVar[SpanContext | None] = ContextVar("cmdop_fixed_ids", default=None)
# The run whose turn this thread executes: the conversation of its model calls.
_RUN: ContextVar[str | None] = ContextVar("cmdop_traced_run", default=None)


def setup(settings: Settings) -> bool:
    """Install the OTLP exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; True if on."""
    global _provider, _tracer
    if _provider is not None or not settings.otlp_endpoint:
        return _provider is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    role: dict[str, str] = {"service.name": SERVICE_NAME, "cmdop.role": "coordinator"}
    if settings.machine is not None:
        role.update({"cmdop.role": "machine", "cmdop.machine": settings.machine})
    provider = TracerProvider(resource=Resource.create(role), id_generator=_run_ids())
    endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _provider, _tracer = provider, provider.get_tracer("cmdop_worker")
    return True


def _run_ids() -> IdGenerator:
    """Random ids, except for the span started while `_FIXED` holds a run's ids."""
    # Defined here: the SDK is imported only by a process that exports traces.
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class RunIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            fixed = _FIXED.get()
            return fixed.trace_id if fixed is not None else super().generate_trace_id()

        def generate_span_id(self) -> int:
            fixed = _FIXED.get()
            return fixed.span_id if fixed is not None else super().generate_span_id()

        def is_trace_id_random(self) -> bool:
            return _FIXED.get() is None

    return RunIds()


def shutdown() -> None:
    """Send what is still buffered (a worker stopping)."""
    if _provider is not None:
        _provider.shutdown()


def run_span_context(run_id: str) -> SpanContext:
    """The run span's ids, derived from the run id: the same in every process."""
    digest = hashlib.sha256(run_id.encode()).digest()
    return SpanContext(
        trace_id=int.from_bytes(digest[:16], "big") or 1,
        span_id=int.from_bytes(digest[16:24], "big") or 1,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )


def _run_parent(run_id: str) -> Context:
    span = run_span_context(run_id)
    assert _provider is not None
    # Sampled as the run span will be (a root sampler decides on the trace id alone).
    decision = _provider.sampler.should_sample(None, span.trace_id, "invoke_agent").decision
    flags = TraceFlags(TraceFlags.SAMPLED if decision.is_sampled() else TraceFlags.DEFAULT)
    parent = SpanContext(span.trace_id, span.span_id, is_remote=True, trace_flags=flags)
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


@contextmanager
def _span(
    name: str, parent: Context | None, kind: SpanKind, attributes: dict[str, Any]
) -> Iterator[trace.Span]:
    assert _tracer is not None
    with _tracer.start_as_current_span(
        name,
        context=parent,
        kind=kind,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as exc:
            _failed(span, exc)
            raise


def _failed(span: trace.Span, exc: BaseException) -> None:
    if isinstance(exc, StopNow):  # a cancel is how a run may end, not a fault
        span.set_attribute("cmdop.cancelled", True)
        return
    kind = getattr(exc, "kind", None)
    span.set_attribute("error.type", str(kind) if kind else type(exc).__qualname__)
    span.set_status(StatusCode.ERROR, str(exc))


@contextmanager
def turn_span(run_id: str, turn: int) -> Iterator[None]:
    """The span of one `cmdop.turn` execution, a child of the run span."""
    if _tracer is None:
        yield
        return
    attributes = {"gen_ai.conversation.id": run_id, "cmdop.run_id": run_id, "cmdop.turn": turn}
    token = _RUN.set(run_id)
    try:
        with _span("cmdop.turn", _run_parent(run_id), SpanKind.INTERNAL, attributes):
            yield
    finally:
        _RUN.reset(token)


@contextmanager
def model_span(request: Mapping[str, Any]) -> Iterator[trace.Span]:
    """A `chat <model>` span around one model call; `record_reply` completes it."""
    if _tracer is None:
        yield trace.INVALID_SPAN
        return
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": str(request.get("model", "")),
        "gen_ai.request.stream": bool(request.get("stream", False)),
    }
    if isinstance(request.get("max_tokens"), int):
        attributes["gen_ai.request.max_tokens"] = request["max_tokens"]
    if (run_id := _RUN.get()) is not None:
        attributes["gen_ai.conversation.id"] = run_id
    name = f"chat {attributes['gen_ai.request.model']}"
    with _span(name, None, SpanKind.CLIENT, attributes) as span:
        yield span


def record_reply(span: trace.Span, reply: ModelReply) -> None:
    if not span.is_recording():
        return
    span.set_attributes(usage_attributes(reply.usage))
    if reply.stop_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [reply.stop_reason])
    if reply.model:
        span.set_attribute("gen_ai.response.model", reply.model)
    if reply.response_id:
        span.set_attribute("gen_ai.response.id", reply.response_id)


def note_retry(attempt: int, delay_s: float, cause: str) -> None:
    """A failed attempt of the current model call, as an event on its span."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event("retry", {"attempt": attempt, "delay_s": delay_s, "cause": cause})


def usage_attributes(usage: Usage) -> dict[str, int]:
    # The conventions count cached input in gen_ai.usage.input_tokens; Anthropic does not.
    cached = usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    return {
        "gen_ai.usage.input_tokens": usage.input_tokens + cached,
        "gen_ai.usage.output_tokens": usage.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cache_read_input_tokens,
        "gen_ai.usage.cache_creation.input_tokens": usage.cache_creation_input_tokens,
    }


def trace_headers() -> dict[str, str]:
    """The current span's context as message headers (`traceparent`), for a tool call."""
    carrier: dict[str, str] = {}
    if _tracer is not None:
        from opentelemetry import propagate

        propagate.inject(carrier)
    return carrier


@contextmanager
def tool_span(call: ToolCall, headers: Mapping[str, Any] | None) -> Iterator[None]:
    """The `execute_tool` span of a call on its machine, a child of the turn that sent it
    (from the message's `headers`), or else of the run."""
    if _tracer is None:
        yield
        return
    from opentelemetry import propagate  # imported by a process that exports traces only

    parent = propagate.extract({k: v for k, v in (headers or {}).items() if isinstance(v, str)})
    if not trace.get_current_span(parent).get_span_context().is_valid:
        parent = _run_parent(call.run_id)
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": call.tool,
        "gen_ai.tool.call.id": call.tool_use_id,
        "gen_ai.tool.type": "function",
        "gen_ai.conversation.id": call.run_id,
        "cmdop.machine": call.machine,
        "cmdop.turn": call.turn,
    }
    with _span(f"execute_tool {call.tool}", parent, SpanKind.INTERNAL, attributes):
        yield


def emit_run_span(state: RunState, result: RunResult) -> None:
    """The run's `invoke_agent` span, from its start until now, with the derived ids."""
    if _tracer is None:
        return
    agent = state.request.agent
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": agent,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": state.model,
        "gen_ai.conversation.id": state.run_id,
        "cmdop.run_id": state.run_id,
        "cmdop.run.status": result.status,
        "cmdop.run.stop_reason": result.stop_reason,
        "cmdop.run.turns": result.turns,
        **usage_attributes(result.usage),
    }
    links = []
    if state.parent is not None:  # a child run of `ask_machine`: its own trace, linked
        links.append(Link(run_span_context(state.parent.run_id), {"cmdop.link": "parent_run"}))
    token = _FIXED.set(run_span_context(state.run_id))
    try:
        span = _tracer.start_span(
            f"invoke_agent {agent}",
            context=Context(),  # a root, whatever span is current
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            links=links,
            start_time=state.started_ms * 1_000_000,
        )
    finally:
        _FIXED.reset(token)
    if result.error is not None:
        span.set_attribute("error.type", result.error.kind)
        span.set_status(StatusCode.ERROR, result.error.message)
    span.end()
