"""A run's side of its thread: steering at loop boundaries, handing the thread on.

Called by the turn task (`apply_steers` when a turn begins: the model's next request
is built right after, so it sees the message; `steers_pending` before a run would
finish, so a message that came during the last model call is answered instead of
dropped) and by `finish` when a run on a thread ends (`hand_on`).

A steering message joins the run's history as text in the user message that opens the
turn: after the previous turn's tool results (the API allows text after
`tool_result` blocks in one message), or as a user message of its own after an
assistant reply. `RunState.steers_applied` counts the messages taken, so a turn
executed again takes none twice. Messages that came too late for any boundary (the run
ended first) are not lost: `hand_on` starts a follow-up run on the thread with them.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from cmdop_worker.coordinator.runs import send_start
from cmdop_worker.models import Message
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.store import RunState

log = logging.getLogger(__name__)


def apply_steers(rt: Runtime, state: RunState, turn: int) -> RunState:
    """`state` with the run's new steering messages in its history, each announced
    by a STEERED event."""
    if state.request.thread_id is None:
        return state
    texts = rt.threads.steers(state.run_id, after=state.steers_applied)
    if not texts:
        return state
    for text in texts:
        rt.events.emit(state.run_id, "STEERED", turn, {"text": text})
    log.info("run %s: %d steering message(s) at turn %s", state.run_id, len(texts), turn)
    return state.model_copy(
        update={
            "history": with_user_text(state.history, texts),
            "steers_applied": state.steers_applied + len(texts),
        }
    )


def steers_pending(rt: Runtime, state: RunState) -> bool:
    if state.request.thread_id is None:
        return False
    return bool(rt.redis.llen(rt.keys.steer(state.run_id)) > state.steers_applied)


def with_user_text(history: list[Message], texts: list[str]) -> list[Message]:
    """`history` with `texts` as text blocks of a user message at its end."""
    blocks = [{"type": "text", "text": text} for text in texts]
    last = history[-1] if history else None
    if last is None or last.role != "user":
        return [*history, Message(role="user", content=blocks)]
    content = (
        [{"type": "text", "text": last.content}] if isinstance(last.content, str) else last.content
    )
    return [*history[:-1], Message(role="user", content=[*content, *blocks])]


def hand_on(rt: Runtime, state: RunState) -> None:
    """The run ended: its history becomes the thread's, and the thread goes to the next
    request waiting for it (and to late steering messages, as a follow-up run)."""
    thread_id = state.request.thread_id
    if thread_id is None:
        return
    late = rt.threads.steers(state.run_id, after=state.steers_applied)
    following = rt.threads.release(thread_id, state.run_id, state.history, now_ms=now_ms())
    if following is not None:
        send_start(following)
    if late:
        log.info("run %s ended before %d steering message(s)", state.run_id, len(late))
        send_start(_follow_up(state, late))


def _follow_up(state: RunState, texts: list[str]) -> dict[str, Any]:
    request = state.request
    body: dict[str, Any] = {
        "run_id": uuid.uuid4().hex,
        "thread_id": request.thread_id,
        "prompt": "\n\n".join(texts),
        "agent": request.agent,
        "on_busy": "enqueue",
    }
    if request.machine is not None:
        body["machine"] = request.machine
    return body
