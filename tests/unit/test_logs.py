"""Structured log lines: the run, turn, tool and machine on every line, text or JSON."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator

import pytest

from cmdop_worker import logs


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, logging.StreamHandler[io.StringIO]]]:
    logger = logging.getLogger(f"test-logs-{id(object())}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(io.StringIO())
    logger.addHandler(handler)
    logs.clear()
    yield logger, handler
    logs.clear()


def test_plain_lines_carry_the_context_and_dashes_outside_it(captured) -> None:
    logger, handler = captured
    logs.install(logger, json_lines=False, machine="alpha")
    logger.info("idle")
    logs.bind(run_id="r1", turn=2, tool="execute_command")
    logger.info("working")
    lines = handler.stream.getvalue().splitlines()
    assert "run=- turn=- tool=- machine=alpha" in lines[0]
    assert "run=r1 turn=2 tool=execute_command machine=alpha" in lines[1]
    assert lines[1].endswith(": working")


def test_json_lines(captured) -> None:
    logger, handler = captured
    logs.install(logger, json_lines=True)
    with logs.log_context(run_id="r2", machine="beta"):
        logger.warning("careful %s", "now")
    line = json.loads(handler.stream.getvalue())
    assert line["run_id"] == "r2" and line["machine"] == "beta" and line["turn"] == "-"
    assert line["message"] == "careful now" and line["level"] == "WARNING"


def test_a_block_context_ends_with_the_block_and_threads_do_not_share(captured) -> None:
    with logs.log_context(run_id="outer"):
        with logs.log_context(turn=3):
            assert logs.current_context() == {"run_id": "outer", "turn": 3}
        assert logs.current_context() == {"run_id": "outer"}
        seen: list[dict[str, object]] = []
        thread = threading.Thread(target=lambda: seen.append(logs.current_context()))
        thread.start()
        thread.join()
        assert seen == [{}]
    assert logs.current_context() == {}


def test_installing_twice_adds_one_filter(captured) -> None:
    logger, handler = captured
    logs.install(logger, json_lines=False)
    logs.install(logger, json_lines=True)
    assert sum(isinstance(f, logs.ContextFilter) for f in handler.filters) == 1
    assert isinstance(handler.formatter, logs.JsonFormatter)


def test_a_thread_that_dies_logs_one_record_with_its_traceback(captured) -> None:
    logger, handler = captured
    logs.install(logger, json_lines=False)
    watcher = logging.getLogger(logs.__name__)
    watcher.addHandler(handler)
    default_hook = threading.excepthook
    logs.log_thread_crashes()
    try:

        def crash() -> None:
            raise ConnectionError("redis went away")

        thread = threading.Thread(target=crash, name="cmdop-test-crash")
        thread.start()
        thread.join()
    finally:
        threading.excepthook = default_hook
        watcher.removeHandler(handler)
    lines = handler.stream.getvalue().splitlines()
    assert "thread cmdop-test-crash died" in lines[0]
    assert lines[1] == "    Traceback (most recent call last):"
    assert lines[-1] == "    ConnectionError: redis went away"


HOSTILE = "evil\x1b]0;owned\x07\x1b[2J\x9b31m\u202egnp.exe\x7f\ud800"


def test_a_plain_line_shows_control_characters_as_text(captured) -> None:
    logger, handler = captured
    logs.install(logger, json_lines=False)
    logs.bind(tool=HOSTILE, machine="m\x1b[1m")
    logger.warning("egress refused %s:%s", HOSTILE, 443)
    line = handler.stream.getvalue()
    assert line.endswith(
        ": egress refused evil\u241b]0;owned\u2407\u241b[2J<U+009B>31m<U+202E>gnp.exe"
        "\u2421<U+D800>:443\n"
    ), line
    assert "tool=evil\u241b]0;owned" in line and "machine=m\u241b[1m" in line
    assert not any(c in line for c in "\x1b\x07\x9b\u202e\x7f")


def test_a_value_cannot_forge_a_line_of_its_own(captured) -> None:
    logger, handler = captured
    logs.install(logger, json_lines=False)
    logger.warning("refused %s", "x\r\n2026-01-01 00:00:00,000 INFO run=- forged")
    try:
        raise ValueError("bad\n2026-01-01 00:00:00,000 INFO forged too")
    except ValueError:
        logger.exception("failed")
    heads = [line for line in handler.stream.getvalue().splitlines() if line[:1] != " "]
    assert len(heads) == 2 and "forged" not in "".join(heads), heads


def test_a_json_line_escapes_what_a_terminal_acts_on_and_parses_back(captured) -> None:
    logger, handler = captured
    logs.install(logger, json_lines=True)
    logs.bind(tool=HOSTILE + "\U000e0041")
    logger.warning("egress refused %s", HOSTILE)
    text = handler.stream.getvalue()
    assert not any(c in text for c in "\x1b\x07\x9b\u202e\x7f")
    assert "\\u009b" in text and "\\u202e" in text and "\\udb40\\udc41" in text
    line = json.loads(text)
    assert line["message"] == f"egress refused {HOSTILE}"
    assert line["tool"] == HOSTILE + "\U000e0041"
