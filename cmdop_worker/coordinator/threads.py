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
ended first) are not lost: `hand_on` puts a follow-up run with them first in the
thread's queue (`follow_up_id`).
"""

from __future__ import annotations

import logging
from typing import Any

from cmdop_worker.core.event_data import SteeredData
from cmdop_worker.messages import send_start
from cmdop_worker.models import Message
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state import starts
from cmdop_worker.state.store import RunState

log = logging.getLogger(__name__)


def apply_steers(rt: Runtime, state: RunState, turn: int, *, upto: int | None = None) -> RunState:
    """`state` with the run's new steering messages in its history, each announced
    by a STEERED event; `upto`: only as many as make that count (a turn resumed with
    a reply written before later ones came: `coordinator.eager`)."""
    if state.request.thread_id is None:
        return state
    texts = rt.threads.steers(state.run_id, after=state.steers_applied)
    if upto is not None:
        texts = texts[: max(upto - state.steers_applied, 0)]
    if not texts:
        return state
    for text in texts:
        rt.events.emit(state.run_id, turn, SteeredData(text=text))
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
    return rt.threads.steer_count(state.run_id) > state.steers_applied


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
    """The run is ending: its history becomes the thread's, and the thread goes to the
    next request waiting for it — first to the messages that came too late to steer it,
    as a follow-up run. Called before the terminal event is written, so whoever sees the
    run end finds the thread free and holding its history; a call again (the turn
    executed again after a crash) changes nothing and sends the next start again."""
    thread_id = state.request.thread_id
    if thread_id is None:
        return
    late = rt.threads.steers(state.run_id, after=state.steers_applied)
    follow_up = _follow_up(state, late) if late else None
    if late:
        log.info("run %s ends before %d steering message(s)", state.run_id, len(late))
    following = rt.threads.release(
        thread_id, state.run_id, state.history, now_ms=now_ms(), follow_up=follow_up
    )
    if following is not None:
        starts.expect(rt.redis, rt.keys, following, now_ms=now_ms())  # kept until handled
        send_start(following)


def follow_up_id(run_id: str) -> str:
    """The id of the run that answers a run's late steering messages: one per run, so
    a second hand-on of the same run starts no second one."""
    return f"{run_id[:59]}-late"


def _follow_up(state: RunState, texts: list[str]) -> dict[str, Any]:
    request = state.request
    carried = request.model_dump(
        mode="json",
        exclude_none=True,
        include={
            "agent",
            "model",
            "max_turns",
            "machine",
            "platform",
            "mode",
            "parallel_tools",
            "stream",
            "timeout_s",
            "token_budget",
            "metadata",
        },
    )
    return {
        **carried,
        "run_id": follow_up_id(state.run_id),
        "thread_id": request.thread_id,
        "prompt": "\n\n".join(texts),
        "on_busy": "enqueue",
    }
