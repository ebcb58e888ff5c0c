"""Fixtures the unit tier shares: the project's fake model server, started once.

`fake` is that server reset for one test (no faults, no recorded requests, an empty
prompt cache, full rate limits, the built-in default script), so no test sees what
another left behind. Modules that need scripts of their own add them per test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cmdop_worker.testing.fake_anthropic import FakeAnthropic


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def fake(fake_server: FakeAnthropic) -> FakeAnthropic:
    fake_server.reset()
    fake_server.set_default("default")
    return fake_server


def answer_with(fake: FakeAnthropic, text: str) -> None:
    """Make `text` the fake's reply to any request: a one-turn script, the default."""
    fake.add_script("answer", [[{"type": "text", "text": text}]])
    fake.set_default("answer")
