"""The fleet base the code-running and outsider corpora share: a Redis with a password
and one coordinator whose approvals time out in 1 s, with 16 slots per worker.

Started once for this package; each module starts its own machines on it for its own
policies (`PolicyBase.machines`) and stops them when it ends. Every attempt is its own
run with its own markers, so no test depends on another's state. The sandbox corpus
keeps a fleet of its own: its Redis password and API key are the secrets it hunts for.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ...conftest import PolicyBase, policy_base


@pytest.fixture(scope="package")
def attack_base(
    fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PolicyBase]:
    logs = tmp_path_factory.mktemp("attack-logs")
    with policy_base(fake_model, logs, approval_timeout_s="1", worker_concurrency="16") as base:
        yield base
