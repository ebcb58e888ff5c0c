"""Label selectors: what each spelling means, what a bad one is told, and properties.

The table fixes the meaning of each form on a few label sets; the error table fixes the
column and the words; the properties check, over generated selectors, that the canonical
text parses back to the same selector, that every accepted spelling of a selector is the
same selector, and that matching agrees with a reference written from Kubernetes'
documented meaning (a negated form is the complement of its positive one).
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmdop_worker.core.selectors import (
    EVERY,
    MAX_SELECTOR_CHARS,
    Op,
    Requirement,
    Selector,
    SelectorError,
    parse_selector,
    selected,
    selector_argument,
)
from cmdop_worker.models import MachinePresence

WEB_PROD = {"role": "web", "env": "prod", "region": "eu"}
WEB_STAGING_CANARY = {"role": "web", "env": "staging", "region": "us", "canary": ""}
DB = {"role": "db", "example.com/tier": "gold"}
NONE: dict[str, str] = {}
MACHINES = {"web-prod": WEB_PROD, "web-staging": WEB_STAGING_CANARY, "db": DB, "bare": NONE}


@pytest.mark.parametrize(
    ("text", "matched"),
    [
        ("*", {"web-prod", "web-staging", "db", "bare"}),
        ("  *  ", {"web-prod", "web-staging", "db", "bare"}),
        ("role=web", {"web-prod", "web-staging"}),
        ("role==web", {"web-prod", "web-staging"}),
        ("role = web", {"web-prod", "web-staging"}),
        ("role!=web", {"db", "bare"}),  # absent counts as not equal
        ("env!=staging", {"web-prod", "db", "bare"}),
        ("role=web,env!=staging", {"web-prod"}),
        ("region in (eu,us)", {"web-prod", "web-staging"}),
        ("region in(eu)", {"web-prod"}),
        ("region notin (eu)", {"web-staging", "db", "bare"}),  # absent is not in the set
        ("canary", {"web-staging"}),
        ("!canary", {"web-prod", "db", "bare"}),
        ("canary=", {"web-staging"}),  # the empty value, present
        ("role", {"web-prod", "web-staging", "db"}),
        ("!role", {"bare"}),
        ("example.com/tier=gold", {"db"}),
        ("example.com/tier in (gold, silver),!canary", {"db"}),
        ("role=web,role=db", set()),  # AND of two values of one key: nothing
        ("role in (web,db),env notin (staging),!canary", {"web-prod", "db"}),
    ],
)
def test_a_selector_matches_the_machines_its_form_says(text: str, matched: set[str]) -> None:
    selector = parse_selector(text)
    assert {name for name, labels in MACHINES.items() if selector.matches(labels)} == matched


@pytest.mark.parametrize(
    ("text", "column", "words"),
    [
        ("", 1, "expected a label key, '!KEY' or '*', found the end of the selector"),
        ("   ", 4, "expected a label key, '!KEY' or '*'"),
        ("role in eu", 9, "expected '(' to open the list of values, found 'eu'"),
        ("role in ()", 10, "expected a label value, found ')'"),
        ("role in (a,", 12, "expected a label value, found the end of the selector"),
        ("role in (a b)", 12, "expected ',' or ')' to close the list of values, found 'b'"),
        ("role web", 6, "expected '=', '==', '!=', 'in' or 'notin' after key 'role'"),
        ("a=b=c", 4, "expected ',' or the end of the selector, found '='"),
        ("!canary=x", 8, "expected ',' or the end of the selector, found '='"),
        ("a,,b", 3, "expected a label key or '!KEY', found ','"),
        ("a,", 3, "found the end of the selector"),
        ("!", 2, "expected a label key after '!'"),
        ("*,role=web", 1, "'*' (every machine) stands alone"),
        ("role=*", 6, "label value '*'"),
        ("cpu>4", 4, "'>' is not supported"),
        ("-role=web", 1, "label key '-role': the name must be at most 63 of"),
        ("Example.com/role=web", 1, "the prefix before '/' must be a DNS subdomain"),
        ("role=" + "v" * 64, 6, "label value 'vvv"),
        ("k" * 64, 1, "label key 'kkk"),
        ("role=wé", 6, "label value 'wé'"),
    ],
)
def test_a_bad_selector_says_where_and_what_was_expected(
    text: str, column: int, words: str
) -> None:
    with pytest.raises(SelectorError) as caught:
        parse_selector(text)
    assert caught.value.position == column - 1
    assert f"at column {column}: " in str(caught.value)
    assert words in str(caught.value)
    assert caught.value.pointer().splitlines()[-1] == " " * (column - 1) + "^"


def test_a_selector_error_is_a_value_error_of_the_products_tree() -> None:
    from cmdop_worker.errors import CmdopError

    with pytest.raises(ValueError):
        parse_selector("role in")
    assert issubclass(SelectorError, CmdopError)


def test_an_overlong_selector_is_refused_before_it_is_read() -> None:
    with pytest.raises(SelectorError, match="longer than"):
        parse_selector("a," * MAX_SELECTOR_CHARS)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("*", "*"),
        ("role==web", "role=web"),
        ("role=web,env!=staging", "env!=staging,role=web"),
        ("region in ( us , eu , eu )", "region in (eu,us)"),
        ("!canary ,canary", "!canary,canary"),
        ("role=web,role=web", "role=web"),
        ("env=", "env="),
        ("in in (notin)", "in in (notin)"),  # the operators are words only after a key
    ],
)
def test_the_canonical_text_sorts_dedupes_and_spells_one_way(text: str, canonical: str) -> None:
    assert str(parse_selector(text)) == canonical


def test_a_tool_argument_is_every_machine_when_absent_and_an_error_when_not_text() -> None:
    assert selector_argument(None) == EVERY
    assert selector_argument("role=web") == parse_selector("role=web")
    with pytest.raises(SelectorError, match="a selector is a string"):
        selector_argument(["role=web"])


def test_selected_keeps_the_matching_presences_in_order() -> None:
    def presence(name: str, labels: dict[str, str]) -> MachinePresence:
        return MachinePresence(machine=name, host="h", pid=1, started_ms=0, tools=[], labels=labels)

    fleet = [presence(name, labels) for name, labels in sorted(MACHINES.items())]
    chosen = selected(fleet, parse_selector("role"))
    assert [p.machine for p in chosen] == ["db", "web-prod", "web-staging"]
    assert selected(fleet, EVERY) == fleet
    assert selected(fleet, None) == fleet
    assert selected(fleet, "!role") == [fleet[0]]  # the text parses the same
    with pytest.raises(SelectorError):
        selected(fleet, "role in")


# ---- properties -------------------------------------------------------------------------

NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"
PREFIX = r"[a-z0-9](?:[a-z0-9-]{0,6}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,6}[a-z0-9])?){0,2}"
# A few keys and values recur, so generated selectors and label sets meet often.
SOME_KEYS = ["role", "env", "region", "canary", "in", "notin", "example.com/tier"]
SOME_VALUES = ["web", "db", "prod", "eu", "us", "in"]

names = st.from_regex(NAME, fullmatch=True)
keys = (
    st.sampled_from(SOME_KEYS)
    | names
    | st.builds(
        lambda prefix, name: f"{prefix}/{name}", st.from_regex(PREFIX, fullmatch=True), names
    )
)
values = st.sampled_from(SOME_VALUES) | names
exact_values = values | st.just("")
requirements = st.one_of(
    st.builds(Requirement, keys, st.sampled_from(["=", "!="]), st.tuples(exact_values)),
    st.builds(
        Requirement,
        keys,
        st.sampled_from(["in", "notin"]),
        st.lists(values, min_size=1, max_size=4).map(tuple),
    ),
    st.builds(Requirement, keys, st.sampled_from(["exists", "!"])),
)
selectors = st.lists(requirements, max_size=5).map(lambda rs: Selector(tuple(rs)))
label_sets = st.dictionaries(st.sampled_from(SOME_KEYS), st.sampled_from([*SOME_VALUES, ""]))


@settings(max_examples=300, deadline=None)
@given(selectors)
def test_the_canonical_text_parses_back_to_the_same_selector(selector: Selector) -> None:
    text = str(selector)
    assert parse_selector(text) == selector
    assert str(parse_selector(text)) == text


def spelled(requirement: Requirement, data: st.DataObject) -> str:
    """One of the ways a person may write `requirement`."""
    gap = data.draw(st.sampled_from(["", " ", "  ", "\t"]))
    key, values = requirement.key, list(requirement.values)
    if requirement.op == "exists":
        return f"{gap}{key}{gap}"
    if requirement.op == "!":
        return f"!{gap}{key}"
    if requirement.op == "=":
        return f"{key}{gap}{data.draw(st.sampled_from(['=', '==']))}{gap}{values[0]}"
    if requirement.op == "!=":
        return f"{key}{gap}!={gap}{values[0]}"
    written = data.draw(st.permutations(values + data.draw(st.lists(st.sampled_from(values)))))
    return f"{key} {requirement.op}{gap}({gap}{f'{gap},{gap}'.join(written)}{gap})"


@settings(max_examples=300, deadline=None)
@given(selectors.filter(lambda s: not s.everything), st.data())
def test_every_spelling_of_a_selector_is_that_selector(
    selector: Selector, data: st.DataObject
) -> None:
    parts = [spelled(r, data) for r in selector.requirements]
    parts += data.draw(st.lists(st.sampled_from(parts), max_size=2))  # repeats change nothing
    text = ",".join(data.draw(st.permutations(parts)))
    assert parse_selector(text) == selector


def reference(requirement: Requirement, labels: Mapping[str, str]) -> bool:
    """Kubernetes' documented meaning: each negated form is its positive form's complement
    (so a machine without the label is "not equal" and "not in")."""
    positive: dict[Op, Op] = {"!=": "=", "notin": "in", "!": "exists"}
    if requirement.op in positive:
        opposite = Requirement(requirement.key, positive[requirement.op], requirement.values)
        return not reference(opposite, labels)
    if requirement.key not in labels:
        return False
    return requirement.op == "exists" or labels[requirement.key] in requirement.values


@settings(max_examples=200, deadline=None)
@given(selectors, st.lists(label_sets, min_size=1, max_size=6))
def test_matching_agrees_with_the_reference(
    selector: Selector, fleet: list[dict[str, str]]
) -> None:
    for labels in fleet:
        expected = all(reference(r, labels) for r in selector.requirements)
        assert selector.matches(labels) == expected
        assert parse_selector(str(selector)).matches(labels) == expected


ALPHABET = st.sampled_from([*"ab=!(),* \t-./_", "in", "notin", "role", "é", "<"])


@settings(max_examples=1000, deadline=None)
@given(st.lists(ALPHABET, max_size=24).map("".join) | st.text(max_size=40))
def test_any_text_either_parses_or_raises_a_selector_error_pointing_into_it(text: str) -> None:
    try:
        selector = parse_selector(text)
    except SelectorError as exc:
        assert 0 <= exc.position <= len(text)
        assert exc.text == text
    else:
        assert parse_selector(str(selector)) == selector
