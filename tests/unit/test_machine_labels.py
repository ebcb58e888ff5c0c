"""Machine labels: Kubernetes' rules for keys and values, CMDOP_MACHINE_LABELS and
`--label`, and a presence that carries them (or, from an older worker, none)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cmdop_worker.config import Settings
from cmdop_worker.models import (
    MachinePresence,
    label_key_problem,
    label_value_problem,
    parse_labels,
)
from cmdop_worker.surfaces.machines_cli import machine_labels


@pytest.mark.parametrize(
    "key",
    ["role", "a", "Role_1.x-y", "k" * 63, "example.com/role", "a-b.c/x", "x" * 253 + "/n"],
)
def test_a_kubernetes_label_key_is_accepted(key: str) -> None:
    assert label_key_problem(key) is None


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("", "the name must be"),
        ("-role", "the name must be"),
        ("role-", "the name must be"),
        ("k" * 64, "the name must be"),
        ("ro le", "the name must be"),
        ("example.com/", "the name must be"),
        ("/role", "prefix before '/'"),
        ("Example.com/role", "prefix before '/'"),
        ("a/b/c", "prefix before '/'"),
        ("-a.com/role", "prefix before '/'"),
        ("x" * 254 + "/n", "prefix before '/'"),
    ],
)
def test_a_bad_label_key_is_named_with_the_rule_it_breaks(key: str, why: str) -> None:
    problem = label_key_problem(key)
    assert problem is not None and why in problem and repr(key) in problem


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        *[("", True), ("web", True), ("v" * 63, True), ("a.b_c-d", True)],
        *[("v" * 64, False), ("-web", False), ("web.", False), ("w b", False), ("wé", False)],
    ],
)
def test_a_label_value_is_empty_or_a_short_name(value: str, ok: bool) -> None:
    assert (label_value_problem(value) is None) == ok


def test_labels_are_read_from_a_comma_list() -> None:
    assert parse_labels(" role=web , env=prod,,canary=") == {
        "role": "web",
        "env": "prod",
        "canary": "",
    }
    assert parse_labels("") == {}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("role", "label 'role': expected KEY=VALUE"),
        ("role=web,role=db", "label key 'role' is given twice"),
        ("role=w b", "label value 'w b'"),
        ("=web", "label key ''"),
    ],
)
def test_bad_labels_are_refused_with_the_label_named(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_labels(text)


def test_the_setting_reads_the_environment_and_refuses_a_bad_label(monkeypatch) -> None:
    monkeypatch.setenv("CMDOP_MACHINE_LABELS", "role=web,example.com/tier=gold")
    assert Settings().machine_labels == {"role": "web", "example.com/tier": "gold"}
    monkeypatch.setenv("CMDOP_MACHINE_LABELS", "role=web,Tier-=gold")
    with pytest.raises(ValidationError, match="label key 'Tier-'"):
        Settings()
    with pytest.raises(ValidationError, match="label value 'a b'"):
        Settings(machine_labels={"role": "a b"})


def test_label_flags_go_over_the_environment_key_by_key() -> None:
    merged = machine_labels("role=web,env=prod", ["env=staging", "canary="], machine=True)
    assert parse_labels(merged) == {"role": "web", "env": "staging", "canary": ""}
    assert machine_labels("", [], machine=False) == ""
    with pytest.raises(ValueError, match="goes with --machine"):
        machine_labels("", ["role=web"], machine=False)
    with pytest.raises(ValueError, match="given twice"):
        machine_labels("", ["role=web", "role=db"], machine=True)


def test_a_presence_without_labels_from_an_older_worker_still_reads() -> None:
    older = {"machine": "m1", "host": "h", "pid": 1, "started_ms": 0, "tools": []}
    assert MachinePresence.model_validate(older).labels == {}
    labelled = MachinePresence.model_validate({**older, "labels": {"role": "web"}})
    assert MachinePresence.model_validate_json(labelled.model_dump_json()) == labelled
