"""Values that cross a process boundary: requests, events, tool calls and results.

Everything here is a frozen pydantic model serialised as JSON. The coordinator,
the machine workers, the client and other services exchange nothing else. Owned by
no single side; imported by all of them, including the pure core. An event's data,
one model per event type, is in `core.event_data`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

MACHINE_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
RUN_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
AGENT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"

MachineName = Annotated[str, StringConstraints(pattern=MACHINE_PATTERN)]
RunId = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN)]

# Machine labels, by Kubernetes' rules: a key is a name of at most 63 characters, with an
# optional DNS-subdomain prefix and a slash (`example.com/role`); a value is at most 63
# characters, or empty. Selecting by them is `core.selectors`.
_LABEL_NAME = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)?")
_DNS_LABEL = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")
_LABEL_SHAPE = "at most 63 of A-Z a-z 0-9 . _ -, beginning and ending with a letter or digit"


def label_key_problem(key: str) -> str | None:
    """Why `key` is no label key (Kubernetes' rules), or None when it is one."""
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix)):
        return (
            f"label key {key!r}: the prefix before '/' must be a DNS subdomain "
            "(lowercase letters, digits, '-' and '.', at most 253 characters)"
        )
    if not name or len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        return f"label key {key!r}: the name must be {_LABEL_SHAPE}"
    return None


def label_value_problem(value: str) -> str | None:
    """Why `value` is no label value (empty is one), or None when it is one."""
    if len(value) > 63 or not _LABEL_NAME.fullmatch(value):
        return f"label value {value!r}: it must be empty or {_LABEL_SHAPE}"
    return None


def parse_labels(text: str) -> dict[str, str]:
    """`role=web,env=prod` as a dict; ValueError naming the first bad label."""
    labels: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, equals, value = item.partition("=")
        key, value = key.strip(), value.strip()
        problem = (
            f"label {item!r}: expected KEY=VALUE"
            if not equals
            else label_key_problem(key) or label_value_problem(value)
        )
        if problem is None and key in labels:
            problem = f"label key {key!r} is given twice"
        if problem is not None:
            raise ValueError(problem)
        labels[key] = value
    return labels


# Generous but finite: a request travels through the broker and is stored whole. The
# limit holds for `messages` too, over all their content (`core.intake`).
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 2_000

EventType = Literal[
    "TOKEN",
    "THINKING",
    "TOOL_START",
    "TOOL_END",
    "RETRY",
    "APPROVAL_REQUEST",
    "APPROVAL_RESOLVED",
    "STEERED",
    "ERROR",
    "CANCELLED",
    "DONE",
]
TERMINAL_EVENTS: frozenset[str] = frozenset({"ERROR", "CANCELLED", "DONE"})

CancelChannel = Literal["ui", "operation"]
StopReason = Literal[
    "end_turn",
    "max_tokens",
    "max_turns",
    "budget",
    "cancelled",
    "timeout",
    "error",
    "output_invalid",
]
RunStatus = Literal["running", "done", "error", "cancelled"]
# What a request on a thread does when the thread already has a running run.
OnBusy = Literal["reject", "enqueue", "interrupt", "steer"]
ApprovalVerdict = Literal["approved", "denied", "expired", "cancelled"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Tolerant(BaseModel):
    """Read by clients of other versions: fields a newer writer adds are ignored, so a
    deployed reader keeps working when the contract grows."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class Message(Frozen):
    """One Anthropic message: a role and either a string or a list of content blocks."""

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ThinkingEnabled(Frozen):
    """Extended thinking with a token budget (the API's `ThinkingConfigEnabledParam`)."""

    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1024)]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(Frozen):
    """The model decides when and how much to think (`ThinkingConfigAdaptiveParam`)."""

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingOther(Frozen):
    """`disabled`, or `between_tools` (the SDK's other two forms)."""

    type: Literal["disabled", "between_tools"]


# The API's own `thinking` object, passed through as `thinking_param` gives it.
Thinking = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingOther, Field(discriminator="type")
]


def thinking_param(thinking: BaseModel | None) -> dict[str, Any] | None:
    """The `thinking` request parameter, as the API spells it (unset fields left out)."""
    return None if thinking is None else thinking.model_dump(mode="json", exclude_none=True)


class RunRequest(Frozen):
    """What a caller sends to `cmdop.run`. Exactly one of `prompt` and `messages`."""

    run_id: RunId | None = None
    prompt: Annotated[str, StringConstraints(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = (
        None
    )
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    agent: Annotated[str, StringConstraints(pattern=AGENT_PATTERN)] = "operator"
    model: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = None
    max_turns: Annotated[int, Field(ge=1, le=100)] | None = None
    machine: MachineName | None = None
    tool_tags: (
        Annotated[list[Annotated[str, StringConstraints(max_length=64)]], Field(max_length=64)]
        | None
    ) = None
    platform: Annotated[str, StringConstraints(max_length=64)] | None = None
    mode: Annotated[str, StringConstraints(max_length=64)] | None = None
    parallel_tools: bool = True
    stream: bool | None = None
    timeout_s: Annotated[float, Field(gt=0, le=3600)] | None = None  # default: settings, 300 s
    token_budget: Annotated[int, Field(ge=1)] | None = None  # default: settings
    output_schema: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    parent_run_id: RunId | None = None
    # A conversation: the run starts from the thread's stored history (`state.threads`).
    thread_id: RunId | None = None
    on_busy: OnBusy = "reject"
    # Dollars the run may spend on the model, children included (`llm.pricing`); a
    # child started by ask_machine(s) gets a share of what its parent has left.
    budget_usd: Annotated[float, Field(gt=0, le=1_000_000)] | None = None
    # Extended thinking for this run; default: the agent profile's (none: no thinking).
    thinking: Thinking | None = None
    # A `machines` call (one call, many machines): the most machines it may reach, and
    # how many of them run at once, batch after batch (Ansible's `serial`); default:
    # the agent profile's (100, and every machine at once).
    max_fanout: Annotated[int, Field(ge=1, le=10_000)] | None = None
    serial: Annotated[int, Field(ge=1, le=10_000)] | None = None

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> RunRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class Usage(Frozen):
    """Tokens of model calls and their cost in US dollars (`llm.pricing`); the cost is
    None (unknown, not smaller) once any call it sums had a model without a price."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cost_usd: float | None = 0.0

    def __add__(self, other: Usage) -> Usage:
        cost = (
            None
            if self.cost_usd is None or other.cost_usd is None
            else self.cost_usd + other.cost_usd
        )
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_read_input_tokens=self.cache_read_input_tokens + other.cache_read_input_tokens,
            cache_creation_input_tokens=self.cache_creation_input_tokens
            + other.cache_creation_input_tokens,
            cost_usd=cost,
        )

    @property
    def total_tokens(self) -> int:
        return (
            self.input_tokens
            + self.output_tokens
            + self.cache_read_input_tokens
            + self.cache_creation_input_tokens
        )


class Event(Tolerant):
    """One event of a run, as stored in its stream and published on its channel."""

    run_id: str
    seq: int
    type: EventType
    turn: int
    ts_ms: int
    data: dict[str, Any]

    @property
    def is_terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS


class CancelRequest(Tolerant):
    channel: CancelChannel
    reason: Annotated[str, StringConstraints(max_length=500)] = "user"


class ToolSpec(Frozen):
    """A tool as the model sees it, plus how the fleet routes it."""

    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str
    input_schema: dict[str, Any]
    tags: tuple[str, ...] = ()
    core: bool = False
    machine_bound: bool = True


class ApprovalAnswer(Frozen):
    """How a parked call (an "ask" waiting for a person) was resolved: by a person
    (approved, denied), by its wait running out (expired) or by a cancel."""

    verdict: ApprovalVerdict
    by: str
    reason: str | None = None  # a denial's reason, as the model is told it
    input: dict[str, Any] | None = None  # the input a person edited, to run instead
    answered_ms: int


class ToolCall(Frozen):
    """One tool call addressed to one machine, as sent to `cmdop.machine.<name>`."""

    run_id: RunId
    turn: int
    tool_use_id: str
    tool: str
    machine: MachineName
    input: dict[str, Any]
    deadline_ms: int  # the tool must have ended by then (its timeout, capped by the run's)
    run_deadline_ms: int
    # Set on the task that carries out the answer to a parked call; the machine acts on
    # it only when the call's parked record holds this very answer (`state.approvals`).
    approval: ApprovalAnswer | None = None


ToolStatus = Literal["ok", "error", "invalid", "denied", "offline", "lost", "timeout", "cancelled"]


class ToolOutcome(Frozen):
    """The result of one tool call; `is_error` outcomes go to the model as error results."""

    tool_use_id: str
    tool: str
    machine: str | None = None
    status: ToolStatus = "ok"
    output: str
    duration_ms: int = 0  # its own run time
    waited_ms: int = 0  # the wait for a person's approval before it ran (or was denied)
    # What the call spent on the model: an ask's child runs, their own children included.
    usage: Usage | None = None

    @property
    def is_error(self) -> bool:
        return self.status != "ok"


class RunError(Frozen):
    kind: str
    message: str


class RunResult(Tolerant):
    """The final record of a run, stored at `cmdop:run:<id>:result`."""

    run_id: str
    status: Literal["done", "error", "cancelled"]
    stop_reason: StopReason
    text: str
    output: Any = None
    usage: Usage = Usage()
    turns: int = 0
    error: RunError | None = None
    cancel: CancelRequest | None = None
    messages: list[Message] = []
    metadata: dict[str, Any] | None = None
    model: str | None = None  # the model of the last reply (a fallback's, after a switch)


class MachinePresence(Frozen):
    """What a live machine worker advertises at `cmdop:machine:<name>`."""

    machine: MachineName
    host: str
    pid: int
    started_ms: int
    tools: list[ToolSpec]
    # How its tool processes run: "bwrap", or "off" (CMDOP_SANDBOX=off), with
    # " (as USER)" under CMDOP_TOOL_USER. None from workers that predate the field.
    sandbox: str | None = None
    # Started against a Redis that answers without a password while its tools have
    # network (CMDOP_ALLOW_OPEN_REDIS=1).
    open_redis: bool = False
    # The operator's labels (`--label`, CMDOP_MACHINE_LABELS), which selectors match;
    # empty from workers that predate them.
    labels: dict[str, str] = {}
