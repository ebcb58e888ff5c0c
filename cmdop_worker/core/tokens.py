"""No client sees a token twice, whatever the model call does.

A turn's model call may stream, die part-way, be retried, or fall back to a
non-streaming call. Every attempt's text passes through one `TokenGate` per turn: it
lets through only text beyond what was already emitted, and only while the new attempt
agrees with it. An attempt that diverges (a sampled model may say something else the
second time) emits nothing more; the final answer in `DONE` is always the whole truth.

Called by the model client; pure and deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenGate:
    emitted: str = ""
    _seen: int = 0
    _diverged: bool = False

    def new_attempt(self) -> None:
        self._seen = 0
        self._diverged = False

    def feed(self, delta: str) -> str:
        """The part of `delta` that no client has seen yet ('' when none)."""
        start, self._seen = self._seen, self._seen + len(delta)
        if self._diverged or not delta:
            return ""
        overlap = self.emitted[start : start + len(delta)]
        if not delta.startswith(overlap):
            self._diverged = True
            return ""
        fresh = delta[len(overlap) :]
        self.emitted += fresh
        return fresh

    def rest_of(self, full_text: str) -> str:
        """For a non-streamed answer: what is left to emit of it."""
        self.new_attempt()
        return self.feed(full_text)
