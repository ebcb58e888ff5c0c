"""Pure logic of the fake Anthropic Messages API: scripts, faults, usage and events.

Owns the script and fault formats, which script and turn answer a request, the
rendering of a turn into content blocks, the prompt-cache approximation and the SSE
event sequence. Called by `fake_anthropic` (the HTTP shell), which does all I/O,
sleeping and id generation: nothing here reads a clock, a socket or a random source.

Script (a bare list of turns is accepted for `{"turns": [...]}`, and a bare list of
blocks for `{"content": [...]}`)::

    {"turns": [{"content": [BLOCK, ...], "latency_ms": 0, "fault": FAULT | null,
                "stop_reason": "max_tokens" | null, "pace_tps": null}, ...],
     "latency_ms": 0, "token_delay_ms": 0, "pace_tps": null}
    BLOCK = {"type": "text", "text": str}
          | {"type": "thinking", "thinking": str, "signature": str?}
          | {"type": "redacted_thinking", "data": str?}
          | {"type": "tool_use", "name": str, "input": {...}, "id": str?}

Timing: `latency_ms` (script plus turn) passes before the response starts, as the
API's time to first token. `token_delay_ms` is a fixed wait after each streamed delta.
`pace_tps` makes the model write at that many output tokens per second, as the real
one does (~80, `DEFAULT_PACE_TPS`): each streamed delta waits for its own tokens, and
a reply sent whole waits for all of them (`fake_wire.CHARS_PER_TOKEN` counts them; a
tool_use costs its input's JSON). A turn's `pace_tps` wins over its script's, which
wins over the server's (`FakeAnthropic(pace_tps=...)`); 0 is unpaced.

Thinking is signed by the fake (`fake_rules`), which checks that it comes back
unchanged; a `signature` or `data` given in the script is sent instead, as a forgery.

Text may hold `{{result:N}}`, `{{results}}` and `{{last_user_text}}` (without the
loop's `<system-reminder>` blocks). A request follows the script its latest
`[[script:NAME]]` marker names (`script_turn`): a follow-up on a thread may switch.

A script file maps names to scripts (`parse_scripts` checks one once it is read).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from cmdop_worker.testing.fake_rules import redacted_data, sign_thinking

REDACTED_PAYLOAD = "ZmFrZS1lbmNyeXB0ZWQtdGhpbmtpbmc"  # opaque, as the API's is
SCRIPT_NAME = r"[A-Za-z0-9_.-]+"
MARKER = re.compile(rf"\[\[script:({SCRIPT_NAME})\]\]")
PLACEHOLDER = re.compile(r"\{\{(result:(\d+)|results|last_user_text)\}\}")
REMINDER = re.compile(r"<system-reminder>.*?</system-reminder>", re.DOTALL)
JsonDict = dict[str, Any]
DEFAULT_PACE_TPS = 80.0  # output tokens per second: the real API's order of magnitude


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TextSpec(_Frozen):
    type: Literal["text"]
    text: str


class ThinkingSpec(_Frozen):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # a forged one, to send instead of the fake's own


class RedactedThinkingSpec(_Frozen):
    type: Literal["redacted_thinking"]
    data: str | None = None  # forged, to send instead of the fake's own signed data


class ToolUseSpec(_Frozen):
    type: Literal["tool_use"]
    name: str
    input: JsonDict = Field(default_factory=dict)
    id: str | None = None


BlockSpec = Annotated[
    TextSpec | ThinkingSpec | RedactedThinkingSpec | ToolUseSpec, Field(discriminator="type")
]


class _Fault(_Frozen):
    times: int = Field(default=1, ge=1)  # how many requests the fault applies to


class StatusFault(_Fault):
    """An HTTP error with an Anthropic-shaped body and optional retry-after headers."""

    kind: Literal["status"] = "status"
    status: int = Field(ge=400, le=599)
    retry_after_s: float | None = None
    retry_after_ms: int | None = None
    message: str | None = None


class StallFault(_Fault):
    """Sleep before the response, or in a stream after `after_events` events."""

    kind: Literal["stall"]
    seconds: float = Field(ge=0)
    after_events: int | None = Field(default=None, ge=0)


class ErrorEventFault(_Fault):
    kind: Literal["error_event"]
    after_events: int = Field(default=0, ge=0)


class TruncateFault(_Fault):
    kind: Literal["truncate"]
    after_events: int = Field(default=0, ge=0)


class ResetFault(_Fault):
    kind: Literal["reset"]


class MalformedFault(_Fault):
    kind: Literal["malformed"]


def _fault_tag(value: Any) -> str:
    if isinstance(value, Mapping):
        return str(value.get("kind", "status"))
    return str(getattr(value, "kind", "status"))


Fault = Annotated[
    Annotated[StatusFault, Tag("status")]
    | Annotated[StallFault, Tag("stall")]
    | Annotated[ErrorEventFault, Tag("error_event")]
    | Annotated[TruncateFault, Tag("truncate")]
    | Annotated[ResetFault, Tag("reset")]
    | Annotated[MalformedFault, Tag("malformed")],
    Discriminator(_fault_tag),
]
_FAULTS: TypeAdapter[list[Fault]] = TypeAdapter(list[Fault])


def parse_faults(payload: Any) -> list[Fault]:
    """One fault or a list of them, as JSON values or models."""
    items = payload if isinstance(payload, list) else [payload]
    return _FAULTS.validate_python(items)


class Turn(_Frozen):
    content: list[BlockSpec] = Field(min_length=1)
    latency_ms: float = Field(default=0, ge=0)
    fault: Fault | None = None
    # "max_tokens": the reply hit the output limit; a streamed last tool_use is cut off
    # halfway through its input's JSON, as the API sends it then (`fake_wire`).
    stop_reason: Literal["max_tokens"] | None = None
    pace_tps: float | None = Field(default=None, ge=0)  # None: the script's

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, value: Any) -> Any:
        return {"content": value} if isinstance(value, list) else value


class Script(_Frozen):
    turns: list[Turn] = Field(min_length=1)
    latency_ms: float = Field(default=0, ge=0)
    token_delay_ms: float = Field(default=0, ge=0)
    pace_tps: float | None = Field(default=None, ge=0)  # None: the server's
    # A request for one of these models gets this text instead of the script's turn
    # (e.g. a small model used as an intent classifier).
    model_answers: dict[str, str] = Field(default_factory=dict)

    def turn_for(self, index: int, model: str) -> Turn:
        if model in self.model_answers:
            return Turn(content=[TextSpec(type="text", text=self.model_answers[model])])
        return self.turn(index)

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, value: Any) -> Any:
        return {"turns": value} if isinstance(value, list) else value

    def turn(self, index: int) -> Turn:
        """The turn for `index`; past the end the last turn repeats."""
        return self.turns[min(index, len(self.turns) - 1)]

    def pace_for(self, turn: Turn, server_tps: float) -> float:
        """Output tokens per second for `turn`: its own, else the script's, else the
        server's; 0 is unpaced."""
        for tps in (turn.pace_tps, self.pace_tps):
            if tps is not None:
                return tps
        return server_tps


DEFAULT_SCRIPT = Script(
    turns=[Turn(content=[TextSpec(type="text", text="You said: {{last_user_text}}")])]
)
DEMO_SCRIPT = Script.model_validate(
    [
        [
            {"type": "text", "text": "Let me check both machines."},
            {
                "type": "tool_use",
                "name": "execute_command",
                "input": {"machine": "alpha", "command": "uname -n && uptime"},
            },
            {
                "type": "tool_use",
                "name": "execute_command",
                "input": {"machine": "beta", "command": "uname -n && df -h / | tail -1"},
            },
        ],
        [{"type": "text", "text": "alpha: {{result:0}} / beta: {{result:1}}"}],
    ]
)
BUILTIN_SCRIPTS: Mapping[str, Script] = {"default": DEFAULT_SCRIPT, "demo": DEMO_SCRIPT}


class ScriptFileError(ValueError):
    """A script file that cannot be served; the message is one line naming the problem."""


def parse_scripts(data: Any) -> dict[str, Script]:
    """The scripts of a script file's parsed content: `{name: script, ...}`."""
    if not isinstance(data, Mapping):
        raise ScriptFileError(f"expected a table of scripts by name, got {type(data).__name__}")
    if not data:
        raise ScriptFileError("it defines no scripts")
    scripts = {}
    for name, value in data.items():
        if not re.fullmatch(SCRIPT_NAME, str(name)):
            raise ScriptFileError(f"script name {name!r}: use only letters, digits, '_', '.', '-'")
        try:
            scripts[str(name)] = Script.model_validate(value)
        except ValidationError as exc:
            raise ScriptFileError(f"script {name!r}: {_first_problem(exc)}") from None
    return scripts


def _first_problem(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "the script"
    more = exc.error_count() - 1
    return f"{where}: {error['msg']}" + (f" (and {more} more)" if more else "")


# --- reading a request -------------------------------------------------------------


def messages_of(body: Mapping[str, Any]) -> list[JsonDict]:
    messages = body.get("messages")
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


def _block_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(b.get("text", ""))
            for b in content
            if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


def script_turn(body: Mapping[str, Any], default: str) -> tuple[str, int]:
    """The script a request follows and the index of the turn it asks for.

    The script is named by the `[[script:NAME]]` marker of the latest user message that
    has one (a follow-up on a thread may name a script of its own), else `default`; the
    turn is how many assistant messages came after that message (after the first user
    message, with no marker). Runs are stateless and independent."""
    messages = messages_of(body)
    name, since = default, 0
    for at, message in enumerate(messages):
        if message.get("role") != "user":
            continue
        found = MARKER.search(_block_text(message.get("content")))
        if found is not None:
            name, since = found.group(1), at
    return name, sum(1 for m in messages[since:] if m.get("role") == "assistant")


def _last_user(body: Mapping[str, Any]) -> JsonDict:
    return next((m for m in reversed(messages_of(body)) if m.get("role") == "user"), {})


def tool_results(body: Mapping[str, Any]) -> list[str]:
    """The text of each `tool_result` block of the last user message, in order."""
    content = _last_user(body).get("content")
    blocks = content if isinstance(content, list) else []
    return [
        _block_text(b.get("content"))
        for b in blocks
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]


def substitute(text: str, body: Mapping[str, Any]) -> str:
    results = tool_results(body)

    def replace(match: re.Match[str]) -> str:
        if match.group(2) is not None:
            n = int(match.group(2))
            return results[n] if n < len(results) else f"<no result {n}>"
        if match.group(1) == "results":
            return "; ".join(results)
        return without_reminders(_block_text(_last_user(body).get("content")))

    return PLACEHOLDER.sub(replace, text)


def without_reminders(text: str) -> str:
    """`text` without the coordinator's `<system-reminder>` blocks: an echo shows what
    the user wrote, not what the loop added for the model."""
    return REMINDER.sub("", text).strip()


def render_blocks(
    turn: Turn, body: Mapping[str, Any], new_tool_id: Callable[[], str]
) -> list[JsonDict]:
    """The turn's content blocks as the API returns them."""
    rendered: list[JsonDict] = []
    for spec in turn.content:
        if isinstance(spec, TextSpec):
            rendered.append(
                {"type": "text", "text": substitute(spec.text, body), "citations": None}
            )
        elif isinstance(spec, ThinkingSpec):
            signature = spec.signature or sign_thinking(spec.thinking)
            rendered.append({"type": "thinking", "thinking": spec.thinking, "signature": signature})
        elif isinstance(spec, RedactedThinkingSpec):
            data = spec.data or redacted_data(REDACTED_PAYLOAD)
            rendered.append({"type": "redacted_thinking", "data": data})
        else:
            tool_id = spec.id or new_tool_id()
            rendered.append(
                {"type": "tool_use", "id": tool_id, "name": spec.name, "input": spec.input}
            )
    return rendered
