"""The published JSON Schemas in schemas/ match the models they are generated from."""

from __future__ import annotations

import json

import pytest

from cmdop_worker.surfaces.cli import json_schema, main
from cmdop_worker.surfaces.typed_events import typed_event
from tests.conftest import repo_root

WHICH = ("run-request", "event")


@pytest.mark.parametrize("which", WHICH)
def test_the_copy_in_schemas_is_up_to_date(which: str) -> None:
    path = repo_root() / "schemas" / f"{which}.json"
    assert path.exists(), (
        f"missing {path}: run `cmdop-worker schema {which} > schemas/{which}.json`"
    )
    assert json.loads(path.read_text()) == json_schema(which), (
        f"schemas/{which}.json is stale: refresh it with "
        f"`cmdop-worker schema {which} > schemas/{which}.json` and commit it"
    )


@pytest.mark.parametrize("which", WHICH)
def test_the_cli_prints_the_schema(which: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", which]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema(which)


def test_the_event_schema_is_one_variant_per_event_type() -> None:
    schema = json_schema("event")
    mapping = schema["discriminator"]["mapping"]
    assert set(mapping) == {
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
    }
    done = schema["$defs"]["DoneData"]
    assert set(done["required"]) == {"text", "usage", "turns", "stop_reason"}


def test_typed_events_accept_new_data_fields_and_reject_a_wrong_shape() -> None:
    base = {"run_id": "r", "seq": 1, "turn": 1, "ts_ms": 0}
    event = typed_event({**base, "type": "TOKEN", "data": {"text": "hi", "later_field": 1}})
    assert event.data.text == "hi"
    with pytest.raises(ValueError, match="tool_call_id"):
        typed_event({**base, "type": "TOOL_END", "data": {"tool": "x"}})
