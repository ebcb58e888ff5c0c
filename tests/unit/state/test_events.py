"""Writing an event takes its typed data model: the JSON on the wire is what it was
when the writers built dicts (field names, order, which fields appear), and data of
the wrong kind is refused, by mypy and at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from typing import Any, get_args

import pytest
import redis

from cmdop_worker.core.event_data import (
    ApprovalRequestData,
    ApprovalResolvedData,
    CancelledData,
    DoneData,
    ErrorData,
    EventData,
    RetryData,
    SteeredData,
    TextData,
    ThinkingData,
    TokenData,
    ToolEndData,
    ToolStartData,
)
from cmdop_worker.models import ApprovalAnswer, EventType, ToolOutcome, Usage
from cmdop_worker.state.events import EventSink
from cmdop_worker.state.keys import Keys
from cmdop_worker.surfaces.typed_events import typed_event
from tests.conftest import repo_root

# Building a frame sends nothing: the client is never connected.
SINK = EventSink(redis.Redis(), Keys(), maxlen=10, ttl_s=5, clock_ms=lambda: 1_700_000_000_000)
ENVELOPE = '{"run_id":"r-1","seq":7,"type":"%s","turn":3,"ts_ms":1700000000000,"data":%s}'

USAGE = Usage(input_tokens=3, output_tokens=4, cost_usd=0.25)
USAGE_JSON = (
    '{"input_tokens":3,"output_tokens":4,"cache_read_input_tokens":0,'
    '"cache_creation_input_tokens":0,"cost_usd":0.25}'
)
OK = ToolOutcome(tool_use_id="t1", tool="bash", machine="m1", output="héllo", duration_ms=12)
TIMED_OUT = ToolOutcome(tool_use_id="t2", tool="ask", status="timeout", output="x" * 30)
ANSWERED = ApprovalAnswer(verdict="approved", by="ann", answered_ms=1)
DENIED = ApprovalAnswer(verdict="denied", by="bob", reason="no", input={"x": 1}, answered_ms=1)
ASKED = {"tool_call_id": "t1", "tool": "bash", "machine": "m1", "input": {"command": "rm x"}}
DONE = {"text": "hi", "usage": USAGE, "turns": 2, "stop_reason": "end_turn"}

# Each event's JSON as the writers' dicts built it before the models (the contract's
# events section plus the fields added since), byte for byte.
WIRE: list[tuple[EventData, str, str]] = [
    (TokenData(text='Hé "quoted"\n'), "TOKEN", '{"text":"Hé \\"quoted\\"\\n"}'),
    (ThinkingData(text="hmm"), "THINKING", '{"text":"hmm"}'),
    (
        ToolStartData(tool_call_id="t1", tool="bash", machine="m1", input={"n": [1, 2.5, None]}),
        "TOOL_START",
        '{"tool_call_id":"t1","tool":"bash","machine":"m1","input":{"n":[1,2.5,null]}}',
    ),
    (
        ToolStartData(tool_call_id="t1", tool="ask", machine=None, input={}),
        "TOOL_START",
        '{"tool_call_id":"t1","tool":"ask","machine":null,"input":{}}',
    ),
    (
        ToolEndData.of(OK, max_output_chars=100),
        "TOOL_END",
        '{"tool_call_id":"t1","tool":"bash","machine":"m1","is_error":false,"status":"ok",'
        '"output":"héllo","duration_ms":12,"waited_ms":0}',
    ),
    (
        ToolEndData.of(TIMED_OUT, max_output_chars=10),
        "TOOL_END",
        '{"tool_call_id":"t2","tool":"ask","machine":null,"is_error":true,"status":"timeout",'
        '"output":"xxxxxxxxxx… [20 more characters]","duration_ms":0,"waited_ms":0}',
    ),
    (
        RetryData(attempt=2, delay_ms=1500, cause="overloaded"),
        "RETRY",
        '{"attempt":2,"delay_ms":1500,"cause":"overloaded"}',
    ),
    (
        ApprovalRequestData(**ASKED, reason="asks", timeout_s=60, resolved_input=None),
        "APPROVAL_REQUEST",
        '{"tool_call_id":"t1","tool":"bash","machine":"m1","input":{"command":"rm x"},'
        '"reason":"asks","timeout_s":60.0}',
    ),
    (
        ApprovalRequestData(**ASKED, reason="asks", timeout_s=60.0, resolved_input={"p": "/a"}),
        "APPROVAL_REQUEST",
        '{"tool_call_id":"t1","tool":"bash","machine":"m1","input":{"command":"rm x"},'
        '"reason":"asks","timeout_s":60.0,"resolved_input":{"p":"/a"}}',
    ),
    (
        ApprovalResolvedData.of("t1", ANSWERED),
        "APPROVAL_RESOLVED",
        '{"tool_call_id":"t1","verdict":"approved","by":"ann"}',
    ),
    (
        ApprovalResolvedData.of("t1", DENIED),
        "APPROVAL_RESOLVED",
        '{"tool_call_id":"t1","verdict":"denied","by":"bob","reason":"no","input":{"x":1}}',
    ),
    (SteeredData(text="also x"), "STEERED", '{"text":"also x"}'),
    (ErrorData(kind="llm", message="boom"), "ERROR", '{"kind":"llm","message":"boom"}'),
    (
        CancelledData(channel="ui", reason="stop", partial_text="part", usage=USAGE),
        "CANCELLED",
        '{"channel":"ui","reason":"stop","partial_text":"part","usage":' + USAGE_JSON + "}",
    ),
    (
        DoneData(**DONE, model="claude-x"),
        "DONE",
        '{"text":"hi","usage":' + USAGE_JSON + ',"turns":2,"stop_reason":"end_turn",'
        '"model":"claude-x"}',
    ),
    (  # a request with an output_schema: `output` is written, even when null
        DoneData(**DONE, model=None, output=None),
        "DONE",
        '{"text":"hi","usage":' + USAGE_JSON + ',"turns":2,"stop_reason":"end_turn",'
        '"model":null,"output":null}',
    ),
    (
        DoneData(**DONE, model="m", output={"a": 1}),
        "DONE",
        '{"text":"hi","usage":' + USAGE_JSON + ',"turns":2,"stop_reason":"end_turn",'
        '"model":"m","output":{"a":1}}',
    ),
]


def _written(data: Any) -> str:
    frame = SINK.frame("r-1", 3, data)
    return frame.head + "7" + frame.tail


@pytest.mark.parametrize(("data", "type_", "wire"), WIRE, ids=[t for _, t, _ in WIRE])
def test_each_event_is_written_as_before(data: EventData, type_: str, wire: str) -> None:
    written = _written(data)
    assert written == ENVELOPE % (type_, wire)
    # ... and it reads back as the same data, by the readers' typed models.
    assert typed_event(written).data.model_dump() == data.model_dump()


def test_every_event_type_has_its_one_model() -> None:
    assert {type_ for _, type_, _ in WIRE} == set(get_args(EventType))


@pytest.mark.parametrize(
    "data",
    [{"text": "hi"}, TextData(text="hi"), EventData(), None],
    ids=["dict", "TextData", "EventData", "None"],
)
def test_data_that_names_no_event_type_is_refused(data: Any) -> None:
    with pytest.raises(TypeError, match="one of the event models"):
        SINK.frame("r-1", 3, data)
    with pytest.raises(TypeError, match="one of the event models"):
        SINK.emit("r-1", 3, data)  # refused before any command is sent


def test_the_data_of_a_read_request_is_checked_against_its_model() -> None:
    """What `Approvals.park` takes besides the model: a request's JSON as read back."""
    read = typed_event(_written(WIRE[7][0])).data.model_dump()
    assert _written(ApprovalRequestData.model_validate(read)) == _written(WIRE[7][0])
    with pytest.raises(ValueError, match="timeout_s"):
        ApprovalRequestData.model_validate({**ASKED, "reason": "asks"})


PROBE = """
from cmdop_worker.core.event_data import ErrorData, TextData, TokenData
from cmdop_worker.state.events import EventSink

def write(sink: EventSink) -> None:
    sink.emit("r", 1, TokenData(text="fine"))
    sink.frame("r", 1, ErrorData(kind="k", message="fine"))
    sink.emit("r", 1, TextData(text="neither TOKEN nor THINKING"))
    sink.frame("r", 1, {"text": "a dict"})
    sink.emit("r", 1, ErrorData)
"""


def test_mypy_refuses_data_of_no_event_type() -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "-c", PROBE],
        cwd=repo_root(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    # The probe's own errors only: a module it imports may be mid-edit elsewhere.
    errors = [line for line in checked.stdout.splitlines() if line.startswith("<string>:")]
    assert [line.split(":")[1] for line in errors if ": error:" in line] == ["8", "9", "10"], (
        checked.stdout
    )


def _raw_writes(source: str) -> list[int]:
    """The lines of `source` that call `emit(run_id, type_, turn, raw)`."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "emit"
        and len(node.args) == 4
    ]


def test_no_writer_in_the_package_writes_an_event_from_a_dict() -> None:
    """`emit(run_id, type_, turn, raw)` is for tests that forge events; the fleet's
    writers pass the models. (`frame` has no such form: mypy holds it.)"""
    package = sorted((repo_root() / "cmdop_worker").rglob("*.py"))
    found = {path.name: _raw_writes(path.read_text()) for path in package}
    assert {name: lines for name, lines in found.items() if lines} == {}
    forged = 'rt.events.emit(rid, 1, TokenData(text="x"))\nevents.emit(rid, "DONE", 1, {})\n'
    assert _raw_writes(forged) == [2]
