"""A user-registered tool (`tests/integration/user_tools.py` on `p-bypass` of the
isolated fleet `iso`) is advertised in its machine's presence, and only there."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_user_tool_is_advertised_and_callable(iso, script) -> None:
    presence = json.loads(iso.client.redis.get(iso.client.keys.machine("p-bypass")))
    (spec,) = [t for t in presence["tools"] if t["name"] == "shout"]
    assert spec["tags"] == ["custom"] and spec["core"] is True and spec["machine_bound"] is True
    assert set(spec["input_schema"]["properties"]) == {"text", "times"}
    others = json.loads(iso.client.redis.get(iso.client.keys.machine("p-strict")))
    assert "shout" not in {t["name"] for t in others["tools"]}
