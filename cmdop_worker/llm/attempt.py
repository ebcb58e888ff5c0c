"""One attempt at a turn's model call: a streamed (or whole) request to the API.

`llm.client` decides how many attempts a call gets, on which model, and how long to
wait between them; it makes each one through the turn's `ApiCall`, which holds what
the attempts share: what clients already saw, whether the call still streams, and
whether a call of the reply went out (eager dispatch).

Streaming: the SDK's raw event iterator, folded into the reply by `llm.wire.ReplyStream`
(not the SDK's `MessageStream`, whose accumulator is quadratic in a tool input's size).
Text and thinking deltas go out through `emit` as they arrive, each one through the
turn's `TokenGate`, so a retried or fallen-back call never repeats a token; a
non-streaming call emits its thinking and then its text once, whole.
A stream idle for longer than the idle timeout, or started too close to the deadline,
falls back inline to a non-streaming call for the same turn.

A ui cancel closes the HTTP stream from the cancel hub's thread; the read then fails
and the attempt raises `StopNow`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anthropic
import httpx2

from cmdop_worker.config import Settings
from cmdop_worker.core.step import ModelReply
from cmdop_worker.core.tokens import TokenGate
from cmdop_worker.errors import LeaseLost, ModelError, StopNow
from cmdop_worker.llm.failures import Failure, status_failure
from cmdop_worker.llm.wire import ReplyStream, StreamIncomplete, reply_of
from cmdop_worker.state.cancel import CancelWatch

log = logging.getLogger(__name__)

Emit = Callable[[Literal["TOKEN", "THINKING"], str], None]
# Called at every event of a streamed reply, with the block it closed whole (or None)
# and a getter of the reply as far as it is whole; True once it sent a call on (eager
# dispatch): the model call is then committed to this reply.
OnBlock = Callable[[dict[str, Any] | None, Callable[[], ModelReply]], bool]


@dataclass(frozen=True)
class Endpoint:
    """The API as this process reaches it, and the clock its calls wait on."""

    client: anthropic.Anthropic
    settings: Settings
    sleep: Callable[[float], None]
    monotonic: Callable[[], float]


class ApiCall:
    """One turn's call to the API, made one attempt at a time. `deadline_s` is a
    monotonic time; `request` names the model being tried (the policy moves it on);
    `on_block` sees each event of a streamed reply; `already_emitted`: this turn's text
    clients saw before, not sent again."""

    def __init__(
        self,
        endpoint: Endpoint,
        request: dict[str, Any],
        *,
        stream: bool,
        emit: Emit,
        watch: CancelWatch | None,
        deadline_s: float,
        on_block: OnBlock | None = None,
        already_emitted: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.request = request
        self.emit = emit
        self.watch = watch
        self.deadline_s = deadline_s
        self.streaming = stream
        self.text = TokenGate()
        self.text.emitted = already_emitted
        self.thinking = TokenGate()
        self.reply: ModelReply | None = None
        self.on_block = on_block
        self.committed: ReplyStream | None = None  # the stream a block was sent on from

    def wait(self, delay_s: float) -> None:
        if self.watch is not None:
            if self.watch.event.wait(delay_s):
                raise StopNow()
        else:
            self.endpoint.sleep(delay_s)

    def attempt(self) -> Failure | None:
        """One attempt: None once `reply` holds the reply, else why it failed."""
        failure = self._try()
        if failure is not None and self.committed is not None:
            log.warning(
                "model stream failed after its calls went out (%s); the turn goes on "
                "with the blocks it completed",
                failure.message,
            )
            self.reply = self.committed.partial_reply()
            return None
        return failure

    def time_left(self) -> float:
        return self.deadline_s - self.endpoint.monotonic()

    def _try(self) -> Failure | None:
        self._check_cancel()
        try:
            if self.streaming and self.time_left() > self.endpoint.settings.stream_idle_timeout_s:
                self.reply = self._stream()
            else:
                self.reply = self._create()
            return None
        except (anthropic.APITimeoutError, httpx2.TimeoutException) as exc:
            # A stall mid-stream surfaces as httpx2's ReadTimeout, not the SDK's error.
            self._check_cancel()
            if self.streaming:
                # A stalled stream: fall back inline to a non-streaming call.
                log.warning("model stream idle; falling back to a non-streaming call")
                self.streaming = False
            return Failure("timeout", None, str(exc) or "request timed out")
        except anthropic.APIStatusError as exc:
            self._check_cancel()
            return status_failure(exc)
        except (httpx2.RemoteProtocolError, StreamIncomplete) as exc:
            # The stream ended without message_stop: cut mid-body, or a clean end too early.
            self._check_cancel()
            return Failure("stream_truncated", None, str(exc) or "stream truncated")
        except (anthropic.APIConnectionError, httpx2.HTTPError) as exc:
            self._check_cancel()
            return Failure("connection", None, str(exc) or type(exc).__name__)
        except (anthropic.APIResponseValidationError, ValueError) as exc:
            self._check_cancel()
            return Failure("malformed", None, f"malformed response: {exc}")

    def _check_cancel(self) -> None:
        if self.watch is not None and self.watch.cancelled:
            raise StopNow()
        if self.time_left() <= 0:
            raise ModelError("deadline", "the run's deadline passed during the model call")

    def _timeout(self, read_s: float) -> httpx2.Timeout:
        left = max(self.time_left(), 0.001)
        return httpx2.Timeout(min(read_s, left), connect=min(5.0, left))

    def _create(self) -> ModelReply:
        timeout = self._timeout(self.endpoint.settings.llm_request_timeout_s)
        message = self.endpoint.client.messages.create(**self.request, timeout=timeout)
        reply = reply_of(message)
        # Whole, once the call returns: the thinking first, as a stream would show it.
        if thought := self.thinking.rest_of(_thinking_of(reply)):
            self.emit("THINKING", thought)
        if rest := self.text.rest_of(reply.text):
            self.emit("TOKEN", rest)
        return reply

    def _stream(self) -> ModelReply:
        self.text.new_attempt()
        self.thinking.new_attempt()
        timeout = self._timeout(self.endpoint.settings.stream_idle_timeout_s)
        reply = ReplyStream()
        client = self.endpoint.client
        with client.messages.create(**self.request, stream=True, timeout=timeout) as stream:
            if self.watch is not None:
                self.watch.on_cancel(stream.close)
            for event in stream:
                self._check_cancel()
                streamed = reply.feed(event)
                if streamed is not None:
                    self._forward(*streamed)
                if self.on_block is not None:
                    closed = event.type == "content_block_stop"
                    self._offer(reply, reply.whole_block(event.index) if closed else None)
        return reply.reply()

    def _offer(self, reply: ReplyStream, block: dict[str, Any] | None) -> None:
        """Offer an event (and the block it closed) to `on_block`. Its own failure is
        not the model's (no retry of the reply): it fails the call as it is."""
        assert self.on_block is not None
        try:
            sent = self.on_block(block, reply.partial_reply)
        except (LeaseLost, StopNow):
            raise
        except Exception as exc:
            raise RuntimeError(f"sending a call of the reply failed: {exc!r}") from exc
        if sent:
            self.committed = reply

    def _forward(self, kind: Literal["text", "thinking"], delta: str) -> None:
        if kind == "text":
            if fresh := self.text.feed(delta):
                self.emit("TOKEN", fresh)
        elif fresh := self.thinking.feed(delta):
            self.emit("THINKING", fresh)


def _thinking_of(reply: ModelReply) -> str:
    return "".join(str(b.get("thinking", "")) for b in reply.content if b.get("type") == "thinking")
