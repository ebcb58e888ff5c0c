"""The gate's work is bounded: a command's length is capped, and reading one is linear.

Linear by construction: every regular expression the floor and the parser apply to a
command with an unbounded repeat is RE2 (`machine.linear`), whose matching time is
linear in the text for any pattern; the few left to Python's `re` match a bounded
stretch per attempt or are anchored. The parse walks the tree once, with parents kept
(tree-sitter finds a parent by walking down from the root), and strips at most
`MAX_LAYERS` wrappers a command. The tests below are hang guards under pytest-timeout
over inputs that took minutes before (a quadratic fork-bomb pattern, a cubic brace
pattern, nested `&&` lists), not speed claims.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmdop_worker.machine import floor, shell
from cmdop_worker.machine.linear import Linear
from cmdop_worker.machine.permissions import (
    MAX_COMMAND_BYTES,
    MAX_OPERATORS,
    Policy,
    command_over_limits,
    decide,
)

DENY_TOUCH = Policy(mode="bypass", deny=("execute_command(touch*)",))
ALLOW_LS = Policy(allow=("execute_command(ls *)", "execute_command(true*)"))
SIZE = MAX_COMMAND_BYTES - 64

# Units that, repeated, made some part of the gate superlinear; each to ~64 KB.
ADVERSARIAL = [
    "a",
    "cat <<E ",
    "f() ",
    "ls `ls | ",
    "case x in a) ls | ",
    "{,",
    "{",
    "..{",
    "nice ",
    "true && ",
    "ls >/dev/null && ",
    "ls | ",
    "ls >/dev/null ",
    '"$x',
    "$x",
    "$(",
    "(",
    "x(){ ",
    "function ",
    "a(",
    " ",
    ".env.",
    "\\",
    "bash -c ",
    "sed -e 1e",
    "find . -exec ls ; ",
    "git -c a.b=c ",
    "xargs ",
    "/etc/shadow-",
    "\ud800",
]


def test_the_floor_matches_with_re2_only() -> None:
    patterns = [v for v in vars(floor).values() if isinstance(v, re.Pattern)]
    assert patterns == []
    assert isinstance(floor._BOMB, Linear) and isinstance(floor._SHADOW, Linear)


def test_the_parser_keeps_only_bounded_patterns_in_re() -> None:
    """Each of these matches a bounded stretch per attempt (one escape, one character)
    or is a single anchored character class: linear in Python's `re` too."""
    left = {name for name, v in vars(shell).items() if isinstance(v, re.Pattern)}
    assert left == {"_PLAIN_WORD", "_UNPARSABLE", "_ESCAPED", "_DQ_ESCAPE", "_C_ESCAPE"}
    assert isinstance(shell._BRACES, Linear)


def at_the_limits(unit: str) -> str:
    """`unit` repeated as often as the caps let a line hold it, padded to ~64 KB with a
    word that leaves the line broken (error recovery is where tree-sitter is slowest)."""
    times = SIZE // len(unit.encode("utf-8", "surrogatepass"))
    for operator, limit in MAX_OPERATORS.items():
        if operator in unit:
            times = min(times, limit // unit.count(operator))
    body = unit * times
    return body + ")" + "a" * (SIZE - len(body.encode("utf-8", "surrogatepass")) - 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("unit", ADVERSARIAL)
def test_a_64_kb_adversarial_line_is_decided(unit: str) -> None:
    for command in (
        unit * (SIZE // len(unit.encode("utf-8", "surrogatepass"))),
        at_the_limits(unit),
    ):
        for policy in (DENY_TOUCH, ALLOW_LS):
            decision = decide("execute_command", {"command": command}, policy)
            assert decision.verdict in ("allow", "ask", "deny")
    assert command_over_limits("execute_command", {"command": at_the_limits(unit)}) is None


@pytest.mark.timeout(300)
@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.sampled_from([*ADVERSARIAL, "'", '"', ";", "|", "&", "\n", "}", ")", "`"]),
        min_size=1,
        max_size=4,
    ),
    st.integers(min_value=1_000, max_value=40_000),
)
def test_repeated_shell_fragments_are_decided(units: list[str], size: int) -> None:
    unit = "".join(units)
    command = (unit * (size // len(unit) + 1))[:size]
    decision = decide("execute_command", {"command": command}, DENY_TOUCH)
    assert decision.verdict in ("allow", "ask", "deny")


def test_a_command_over_the_cap_is_refused_unread() -> None:
    command = "ls " + "x" * MAX_COMMAND_BYTES
    decision = decide("execute_command", {"command": command}, Policy(mode="bypass"))
    assert (decision.verdict, decision.source) == ("deny", "floor")
    assert f"the most a machine reads is {MAX_COMMAND_BYTES}" in decision.reason
    wide = "€" * (MAX_COMMAND_BYTES // 3 + 1)  # three bytes each in UTF-8
    assert command_over_limits("execute_command", {"command": wide}) is not None
    assert command_over_limits("execute_command", {"command": "€" * 1000}) is None
    assert command_over_limits("read_file", {"path": "x" * 100_000}) is None
    pipes = "ls | " * (MAX_OPERATORS["|"] + 1) + "ls"
    assert f"holds {MAX_OPERATORS['|'] + 1} '|'" in str(
        command_over_limits("execute_command", {"command": pipes})
    )


@pytest.mark.parametrize(
    ("command", "bomb"),
    [
        (":(){ :|:& };:", True),
        ("xbomb(){ bomb|bomb& }; bomb", True),  # bash defines `xbomb`; the text still reads so
        ("a(){ b|c& }; bomb(){ bomb | bomb & }", True),
        ("function f { f|f& }; f", True),
        ("f ( ) {\tf\t|\tf\t& }", True),
        ("a1(){ 1|1& }", False),
        ("f(){ f|g& }", False),
        ("f(){ f|f; }", False),
    ],
)
def test_the_fork_bomb_check_reads_as_before(command: str, bomb: bool) -> None:
    assert (floor.command_floor_reason(command) == "fork bomb") is bomb


def test_wrappers_nested_past_the_limit_are_opaque() -> None:
    command = "nice " * (shell.MAX_LAYERS + 4) + "touch M"
    found = shell.analyse(command)
    assert "wrappers nested too deeply" in found.hazards
    assert decide("execute_command", {"command": command}, DENY_TOUCH).verdict == "ask"
