"""Fleet bases shared by the integration modules whose private fleets had the same
configuration (the session fleet and its fixtures are in tests/conftest.py).

`plain_base`: a Redis with a password and one coordinator with `isolated_env`'s
defaults and nothing more (`policy_base`). It was one private fleet per module, each
starting its own Redis and coordinator; now it starts once, on first use, and each
module starts its own machines on it, with its own policy and environment, and stops
them when it ends (`stop_machines`). Runs are told apart by run id and script name.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Iterator

import pytest

from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import PolicyBase, policy_base


@pytest.fixture(scope="session")
def plain_base(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PolicyBase]:
    with policy_base(fake_model, tmp_path_factory.mktemp("plain-base-logs")) as base:
        yield base


def stop_machines(base: PolicyBase, machines: Iterable[str]) -> None:
    """Stop the machines a module started on `base`, all at once (`LocalFleet.stop`)."""
    workers = [base.fleet.workers.pop(m) for m in machines if m in base.fleet.workers]
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        worker.stop()
