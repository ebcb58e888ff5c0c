"""A fan-out's limits: the request's, else its agent profile's, else the defaults."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cmdop_worker.config import AgentProfile
from cmdop_worker.coordinator.calls import fanout_limits
from cmdop_worker.core.intake import parse_request

AGENTS = {
    "operator": AgentProfile(name="operator"),
    "rollout": AgentProfile(name="rollout", max_fanout=500, serial=10),
}


@pytest.mark.parametrize(
    ("fields", "limits"),
    [
        ({}, (100, None)),
        ({"agent": "rollout"}, (500, 10)),
        ({"agent": "rollout", "max_fanout": 7, "serial": 2}, (7, 2)),
        ({"serial": 3}, (100, 3)),
    ],
)
def test_the_request_then_the_agent_profile(
    fields: dict[str, object], limits: tuple[int, int | None]
) -> None:
    rt = SimpleNamespace(agents=AGENTS)
    state = SimpleNamespace(request=parse_request({"prompt": "p", **fields}))
    assert fanout_limits(rt, state) == limits  # type: ignore[arg-type]
