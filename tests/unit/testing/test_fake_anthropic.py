"""The fake Anthropic server, driven by the real anthropic SDK over loopback HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.error import HTTPError

import anthropic
import httpx2
import pytest

from cmdop_worker.testing.fake_anthropic import FakeAnthropic
from cmdop_worker.testing.fake_script import Script, parse_faults
from cmdop_worker.testing.fake_wire import input_usage, json_chunks, prefix_points, text_chunks

MODEL = "claude-fake-1"
RICH = [
    [
        {"type": "thinking", "thinking": "The user wants two machines checked at once."},
        {"type": "text", "text": "I will look at both machines in parallel right now."},
        {"type": "tool_use", "name": "execute_command", "input": {"machine": "a", "command": "ls"}},
        {"type": "tool_use", "name": "execute_command", "input": {"machine": "b", "command": "df"}},
    ],
    [{"type": "text", "text": "Done: {{results}}"}],
]


@pytest.fixture(scope="module")
def shared_client(fake_server: FakeAnthropic) -> Iterator[anthropic.Anthropic]:
    # Building an SDK client costs ~40 ms: one per module keeps the file fast.
    with anthropic.Anthropic(base_url=fake_server.url, api_key="test", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(autouse=True)
def _rich(fake: FakeAnthropic) -> None:
    fake.add_script("rich", RICH)


@pytest.fixture
def client(fake: FakeAnthropic, shared_client: anthropic.Anthropic) -> anthropic.Anthropic:
    return shared_client


def user(text: str) -> Any:
    return {"role": "user", "content": text}


def create(client: anthropic.Anthropic, messages: list[Any], **kw: Any) -> Any:
    return client.messages.create(model=MODEL, max_tokens=256, messages=messages, **kw)


def results_message(*texts: str, ids: tuple[str, ...] = ("t0", "t1")) -> dict[str, Any]:
    blocks = [
        {"type": "tool_result", "tool_use_id": i, "content": [{"type": "text", "text": t}]}
        for i, t in zip(ids, texts, strict=True)
    ]
    return {"role": "user", "content": blocks}


def control(fake: FakeAnthropic, method: str, path: str, payload: Any = None) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(fake.url + path, data=data, method=method)
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


# --- answers ------------------------------------------------------------------------


def test_json_turn_has_thinking_text_and_parallel_tool_uses(client: anthropic.Anthropic) -> None:
    message = create(client, [user("[[script:rich]] check a and b")])
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.model == MODEL and message.stop_reason == "tool_use"
    assert message.stop_sequence is None and message.content[0].signature
    first, second = message.content[2], message.content[3]
    assert first.input == {"machine": "a", "command": "ls"}
    assert first.id.startswith("toolu_") and len(first.id) == 26 and first.id != second.id
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_stream_sends_the_anthropic_event_sequence(client: anthropic.Anthropic) -> None:
    with create(client, [user("[[script:rich]] go")], stream=True) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens > 0
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    kinds = [d.type for d in deltas]
    assert kinds.count("text_delta") >= 3 and kinds.count("thinking_delta") >= 2
    assert kinds.index("signature_delta") < kinds.index("text_delta")
    json_parts = [
        (e.index, e.delta.partial_json)
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    per_tool = [[p for i, p in json_parts if i == index] for index in (2, 3)]
    assert all(len(parts) >= 2 for parts in per_tool)
    assert json.loads("".join(per_tool[1])) == {"machine": "b", "command": "df"}
    assert events[-2].delta.stop_reason == "tool_use" and events[-2].usage.output_tokens > 1


def test_stream_helper_final_message_equals_the_json_answer(client: anthropic.Anthropic) -> None:
    messages = [user("[[script:rich]] go")]
    with client.messages.stream(model=MODEL, max_tokens=256, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    plain = create(client, messages)
    assert text == "I will look at both machines in parallel right now."
    strip = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in final.content]
    assert strip == [{k: v for k, v in b.model_dump().items() if k != "id"} for b in plain.content]
    assert final.stop_reason == "tool_use" and final.usage == plain.usage


def test_default_script_echoes_and_marker_picks_turn_by_assistant_count(
    client: anthropic.Anthropic,
) -> None:
    assert create(client, [user("hello fleet")]).content[0].text == "You said: hello fleet"
    history = [user("[[script:rich]] go"), {"role": "assistant", "content": "x"}]
    second = create(client, [*history, results_message("one", "two")])
    assert second.content[0].text == "Done: one; two" and second.stop_reason == "end_turn"
    past_end = [*history, user("more"), {"role": "assistant", "content": "y"}, user("again")]
    assert create(client, past_end).content[0].text.startswith("Done:")


def test_a_follow_up_naming_a_script_switches_to_its_first_turn(
    client: anthropic.Anthropic,
) -> None:
    first_run = [user("[[script:rich]] go"), {"role": "assistant", "content": "x"}]
    follow_up = [*first_run, results_message("one", "two")]
    assert create(client, follow_up).content[0].text == "Done: one; two"  # rich's turn 2
    # A thread's next run: its own marker picks its script, counted from that message.
    switched = [*follow_up, {"role": "assistant", "content": "Done"}, user("[[script:default]] hi")]
    assert create(client, switched).content[0].text == "You said: [[script:default]] hi"


def test_an_echo_shows_what_the_user_wrote_not_the_loops_reminders(
    client: anthropic.Anthropic,
) -> None:
    reminder = "<system-reminder>\nturn 2 of 40; 9000 tokens left\n</system-reminder>"
    message = {
        "role": "user",
        "content": [{"type": "text", "text": "disk usage?"}, {"type": "text", "text": reminder}],
    }
    assert create(client, [message]).content[0].text == "You said: disk usage?"


def test_demo_script_substitutes_each_result(client: anthropic.Anthropic) -> None:
    first = create(client, [user("[[script:demo]] how are alpha and beta?")])
    calls = [b for b in first.content if b.type == "tool_use"]
    assert [c.input["machine"] for c in calls] == ["alpha", "beta"]
    assert calls[0].input["command"] == "uname -n && uptime"
    history = [user("[[script:demo]] hi"), {"role": "assistant", "content": first.content}]
    ids = (calls[0].id, calls[1].id)
    final = create(client, [*history, results_message("up 3 days", "42% used", ids=ids)])
    assert final.content[0].text == "alpha: up 3 days / beta: 42% used"


def test_unknown_script_is_a_bad_request(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="nope"):
        create(client, [user("[[script:nope]]")])


def test_concurrent_runs_are_independent(client: anthropic.Anthropic) -> None:
    def run(i: int) -> str:
        history = [user("[[script:rich]]"), {"role": "assistant", "content": "x"}]
        return str(create(client, [*history, results_message(f"r{i}", "s")]).content[0].text)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(8))) == [f"Done: r{i}; s" for i in range(8)]


# --- faults ---------------------------------------------------------------------------


def test_429_carries_retry_after_headers(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.inject({"status": 429, "retry_after_s": 1.5, "retry_after_ms": 1500, "message": "slow"})
    with pytest.raises(anthropic.RateLimitError, match="slow") as info:
        create(client, [user("hi")])
    assert info.value.response.headers["retry-after"] == "1.5"
    assert info.value.response.headers["retry-after-ms"] == "1500"
    assert info.value.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow"},
    }
    assert create(client, [user("hi")]).content[0].text == "You said: hi"


def test_529_is_overloaded(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.inject({"status": 529})
    with pytest.raises(anthropic.APIStatusError) as info:
        create(client, [user("hi")])
    assert info.value.status_code == 529 and isinstance(info.value, anthropic.OverloadedError)


def test_sdk_retries_honour_retry_after_ms(fake: FakeAnthropic) -> None:
    fake.inject({"status": 503, "retry_after_ms": 10, "times": 2})
    with anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=2) as sdk:
        assert create(sdk, [user("x")]).content[0].text == "You said: x"
    faults = [r["response"]["fault"] for r in fake.requests()]
    assert [f and f["status"] for f in faults] == [503, 503, None]


def test_error_event_mid_stream_raises_while_iterating(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    fake.inject({"kind": "error_event", "after_events": 3})
    seen: list[str] = []
    with pytest.raises(anthropic.APIStatusError, match="overloaded_error") as info:  # noqa: SIM117
        with create(client, [user("hello")], stream=True) as stream:
            seen.extend(e.type for e in stream)
    assert seen == ["message_start", "content_block_start"]  # the ping is skipped
    assert info.value.status_code == 200


def test_truncated_stream_raises_while_iterating(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    fake.inject({"kind": "truncate", "after_events": 4})
    seen: list[str] = []
    with pytest.raises(httpx2.RemoteProtocolError):  # noqa: SIM117
        with client.messages.stream(model=MODEL, max_tokens=9, messages=[user("a b c")]) as stream:
            seen.extend(e.type for e in stream)
    assert "message_stop" not in seen and "content_block_delta" in seen


def test_reset_is_a_connection_error(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.inject({"kind": "reset"})
    with pytest.raises(anthropic.APIConnectionError):
        create(client, [user("hi")])
    assert fake.requests()[0]["response"]["fault"]["kind"] == "reset"


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_body_raises(
    fake: FakeAnthropic, client: anthropic.Anthropic, stream: bool
) -> None:
    fake.inject({"kind": "malformed"})
    with pytest.raises(json.JSONDecodeError):
        if stream:
            with create(client, [user("hi")], stream=True) as events:
                list(events)
        else:
            create(client, [user("hi")])


def test_stall_longer_than_client_timeout_times_out(fake: FakeAnthropic) -> None:
    stall_s = 30.0  # far past the client's timeout: only the timeout can end the call early
    fake.inject({"kind": "stall", "seconds": stall_s})
    with anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0, timeout=0.5) as sdk:
        started = time.monotonic()
        with pytest.raises(anthropic.APITimeoutError):
            create(sdk, [user("hi")])
        assert time.monotonic() - started < stall_s / 2  # the client gave up, not the stall
    (request,) = fake.requests()
    assert request["response"]["fault"]["kind"] == "stall"


def test_stall_mid_stream_then_continues(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.inject({"kind": "stall", "seconds": 0.2, "after_events": 3})
    started = time.monotonic()
    with create(client, [user("hi")], stream=True) as stream:
        assert [e.type for e in stream][-1] == "message_stop"
    # A lower bound only: load can make the call slower, never faster than the stall.
    assert time.monotonic() - started >= 0.2
    (request,) = fake.requests()
    assert request["response"]["fault"]["kind"] == "stall"
    assert request["response"]["fault"]["after_events"] == 3


def test_fault_times_and_per_turn_faults(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.add_script(
        "flaky",
        {"turns": [{"content": [{"type": "text", "text": "ok"}], "fault": {"status": 500}}]},
    )
    fake.inject({"status": 400, "times": 2})
    for _ in range(2):
        with pytest.raises(anthropic.BadRequestError):
            create(client, [user("hi")])
    with pytest.raises(anthropic.InternalServerError):
        create(client, [user("[[script:flaky]]")])
    assert create(client, [user("[[script:flaky]]")]).content[0].text == "ok"


def test_faults_are_validated() -> None:
    stall, status = parse_faults([{"kind": "stall", "seconds": 1}, {"status": 429}])
    assert stall.kind == "stall" and status.kind == "status"
    with pytest.raises(ValueError):
        parse_faults({"kind": "stal", "seconds": 1})
    with pytest.raises(ValueError):
        Script.model_validate({"turns": []})


# --- recordings and usage ---------------------------------------------------------------


def test_requests_are_recorded_with_auth_redacted(fake: FakeAnthropic) -> None:
    with anthropic.Anthropic(base_url=fake.url + "/", api_key="sk-secret", max_retries=0) as sdk:
        message = create(sdk, [user("[[script:rich]] go")])
        sdk.messages.create(
            model=MODEL, max_tokens=5, messages=[user("b")], extra_query={"beta": "true"}
        )
    first, second = fake.requests()
    assert "sk-secret" not in json.dumps(first)
    assert first["headers"]["authorization"] == "<redacted>" and first["path"] == "/v1/messages"
    assert first["body"]["messages"] == [user("[[script:rich]] go")]
    assert [b.get("id") for b in first["response"]["content"]] == [
        getattr(b, "id", None) for b in message.content
    ]
    assert (
        second["path"] == "/v1/messages?beta=true" and second["received_ms"] >= first["received_ms"]
    )
    fake.reset()
    assert fake.requests() == []


def cached_request(system_text: str, *extra: dict[str, Any]) -> dict[str, Any]:
    system = [{"type": "text", "text": system_text * 40, "cache_control": {"type": "ephemeral"}}]
    return {"model": MODEL, "system": system, "messages": [user("hi"), *extra]}


def test_identical_cached_prefix_is_read_and_a_changed_one_is_not(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    def usage(body: dict[str, Any]) -> Any:
        return client.messages.create(max_tokens=10, **body).usage

    first = usage(cached_request("You operate machines. "))
    assert first.cache_creation_input_tokens > 0 and first.cache_read_input_tokens == 0
    again = usage(cached_request("You operate machines. "))
    assert again.cache_read_input_tokens == first.cache_creation_input_tokens
    assert again.cache_creation_input_tokens == 0 and again.input_tokens == first.input_tokens
    changed = usage(cached_request("You operate servers. "))
    assert changed.cache_read_input_tokens == 0 and changed.cache_creation_input_tokens > 0
    fake.reset()
    assert usage(cached_request("You operate machines. ")).cache_read_input_tokens == 0


def test_moved_breakpoint_reads_the_earlier_prefix() -> None:
    mark = {"cache_control": {"type": "ephemeral"}}
    turn1 = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a" * 400, **mark}]}]
    }
    turn2 = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a" * 400}]},
            {"role": "assistant", "content": "b" * 400},
            {"role": "user", "content": [{"type": "text", "text": "c" * 40, **mark}]},
        ]
    }
    first = input_usage(prefix_points(turn1), set())
    second = input_usage(prefix_points(turn2), set(first.written))
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens > 100
    assert second.cache_creation_input_tokens > 100 and second.input_tokens == 0
    no_breakpoint = input_usage(
        prefix_points({"messages": turn2["messages"][:1]}), set(first.written)
    )
    assert no_breakpoint.cache_read_input_tokens == 0


def test_chunking_keeps_all_text() -> None:
    text = "  one two three four five six seven "
    assert "".join(text_chunks(text)) == text and len(text_chunks(text)) == 3
    assert len(json_chunks({})) == 2 and "".join(json_chunks({"a": [1]})) == '{"a": [1]}'


# --- control API and CLI ----------------------------------------------------------------


def test_control_api_over_http(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    assert control(fake, "GET", "/_fake/health")["ok"] is True
    control(fake, "PUT", "/_fake/scripts/hi", [[{"type": "text", "text": "Hi from HTTP"}]])
    control(fake, "PUT", "/_fake/default", {"script": "hi"})
    assert create(client, [user("x")]).content[0].text == "Hi from HTTP"
    control(fake, "POST", "/_fake/faults", [{"status": 429}, {"status": 529}])
    with pytest.raises(anthropic.RateLimitError):
        create(client, [user("x")])
    assert len(control(fake, "GET", "/_fake/requests")) == 2
    control(fake, "POST", "/_fake/reset")
    assert control(fake, "GET", "/_fake/requests") == []
    assert create(client, [user("x")]).content[0].text == "Hi from HTTP"  # 529 was cleared
    with pytest.raises(HTTPError) as info:
        control(fake, "PUT", "/_fake/scripts/bad", {"turns": [[{"type": "video"}]]})
    info.value.close()
    assert info.value.code == 400


def test_cli_prints_its_url_and_stops_on_sigterm(tmp_path: Path) -> None:
    script_file = tmp_path / "scripts.json"
    script_file.write_text(json.dumps({"hello": [[{"type": "text", "text": "hi"}]]}))
    module = "cmdop_worker.testing.fake_anthropic"
    command = [sys.executable, "-m", module, "--port", "0", "--script-file", str(script_file)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "/_fake/health", timeout=5) as response:
            assert "hello" in json.loads(response.read())["scripts"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0


def test_a_body_cut_short_is_recorded_empty_and_marked(fake: FakeAnthropic) -> None:
    # What a coordinator SIGKILLed mid-request leaves: a body that is no JSON.
    request = urllib.request.Request(
        f"{fake.url}/v1/messages",
        data=b'{"model": "x", "messa',
        headers={"content-type": "application/json"},
        method="POST",
    )
    with pytest.raises(HTTPError):
        urllib.request.urlopen(request, timeout=10)
    (entry,) = fake.requests()
    assert entry["body"] == {} and entry["malformed"] is True
