"""Label selectors: which machines a `role=web,env!=staging` names, with no I/O.

The syntax and meaning are Kubernetes' label selectors, plus `*` for every machine:

    selector     := '*' | requirement (',' requirement)*        (',' is AND)
    requirement  := '!' KEY                                      the label is absent
                  | KEY                                          the label is present
                  | KEY ('=' | '==') VALUE                       present, and equal
                  | KEY '!=' VALUE                               absent, or not equal
                  | KEY 'in' '(' VALUE (',' VALUE)* ')'          present, and one of them
                  | KEY 'notin' '(' VALUE (',' VALUE)* ')'       absent, or none of them

Whitespace between tokens is ignored. KEY and VALUE follow Kubernetes' label rules
(`models.label_key_problem`, `models.label_value_problem`); a VALUE after `=`, `==` or
`!=` may be empty (`env=` names an empty value), as in Kubernetes. Two departures,
both stricter or plainer: an empty selector is an error rather than "everything" (a
fan-out over every machine is asked for with `*`, never by omission), and a set lists
at least one non-empty value. `in` and `notin` are operators only after a key, so a
label named `in` can still be selected. Kubernetes' `<` and `>` are not supported.

Parsed by hand, by recursive descent over a small tokenizer, as Kubernetes' own
`labels.Parse` does: the grammar is six productions, a hand parser gives each error
its column and what was expected there in the words of this grammar, and the core
takes on no dependency. `parse_selector` returns a canonical `Selector`: requirements
sorted and deduplicated, set values sorted and deduplicated, `==` written `=`, so
`str(parse_selector(str(s))) == str(s)` and two spellings of one selector compare
equal. Called by the coordinator's `list_machines`, the CLI's `machines --selector`
and the gateway's `/v1/machines?selector=`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, TypeVar

from cmdop_worker.errors import CmdopError
from cmdop_worker.models import label_key_problem, label_value_problem

MAX_SELECTOR_CHARS = 4096
Op = Literal["=", "!=", "in", "notin", "exists", "!"]
TokenKind = Literal["word", "(", ")", ",", "=", "==", "!=", "!", "end"]
_SPECIAL = frozenset("()!=,<>")
_PUNCTUATION: dict[str, TokenKind] = {
    "(": "(",
    ")": ")",
    ",": ",",
    "=": "=",
    "!": "!",
    "==": "==",
    "!=": "!=",
}
_SET_OPS: frozenset[str] = frozenset({"in", "notin"})


class SelectorError(CmdopError, ValueError):
    """A selector that does not parse: where (`position`, 0-based) and what was wrong."""

    def __init__(self, text: str, position: int, reason: str) -> None:
        self.text = text
        self.position = position
        self.reason = reason
        super().__init__(f"bad selector {text!r}: at column {position + 1}: {reason}")

    def pointer(self) -> str:
        """The selector and a caret under the column at fault, for a terminal."""
        return f"{self.text}\n{' ' * self.position}^"


@dataclass(frozen=True, order=True)
class Requirement:
    """One condition on one label; `values` holds the operand(s), sorted and unique."""

    key: str
    op: Op
    values: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(sorted(set(self.values))))

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.op == "exists":
            return value is not None
        if self.op == "!":
            return value is None
        if self.op in ("=", "in"):
            return value is not None and value in self.values
        return value is None or value not in self.values  # "!=", "notin"

    def __str__(self) -> str:
        if self.op == "exists":
            return self.key
        if self.op == "!":
            return f"!{self.key}"
        if self.op in ("=", "!="):
            return f"{self.key}{self.op}{self.values[0]}"
        return f"{self.key} {self.op} ({','.join(self.values)})"


@dataclass(frozen=True)
class Selector:
    """All of `requirements` (sorted and unique); none at all is `*`, every machine."""

    requirements: tuple[Requirement, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "requirements", tuple(sorted(set(self.requirements))))

    @property
    def everything(self) -> bool:
        return not self.requirements

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)

    def __str__(self) -> str:
        return ",".join(str(r) for r in self.requirements) or "*"


EVERY = Selector()


class Labelled(Protocol):
    @property
    def labels(self) -> Mapping[str, str]: ...


_L = TypeVar("_L", bound=Labelled)


def selected(items: Iterable[_L], selector: Selector | str | None) -> list[_L]:
    """The items (machine presences) whose labels `selector` (or its text; None is `*`)
    matches, in their order."""
    if selector is None:
        return list(items)
    chosen = parse_selector(selector) if isinstance(selector, str) else selector
    return [item for item in items if chosen.matches(item.labels)]


def selector_argument(value: object) -> Selector:
    """A tool's `selector` argument: every machine when absent (None)."""
    if value is None:
        return EVERY
    if not isinstance(value, str):
        raise SelectorError(repr(value)[:60], 0, "a selector is a string, such as role=web or *")
    return parse_selector(value)


def parse_selector(text: str) -> Selector:
    """The selector `text` spells; SelectorError saying where and what was expected."""
    if len(text) > MAX_SELECTOR_CHARS:
        raise SelectorError(text[:40] + "…", 0, f"longer than {MAX_SELECTOR_CHARS} characters")
    if text.strip() == "*":
        return EVERY
    return _Parser(text).selector()


class _Token(NamedTuple):
    kind: TokenKind
    text: str
    position: int

    def shown(self) -> str:
        return "the end of the selector" if self.kind == "end" else repr(self.text)


def _tokens(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char.isspace():
            i += 1
        elif char in "<>":
            raise SelectorError(
                text, i, f"{char!r} is not supported: use =, ==, !=, in, notin, KEY or !KEY"
            )
        elif char in _SPECIAL:
            mark = text[i : i + 2] if text[i : i + 2] in ("==", "!=") else char
            tokens.append(_Token(_PUNCTUATION[mark], mark, i))
            i += len(mark)
        else:
            start = i
            while i < len(text) and not text[i].isspace() and text[i] not in _SPECIAL:
                i += 1
            tokens.append(_Token("word", text[start:i], start))
    tokens.append(_Token("end", "", len(text)))
    return tokens


class _Parser:
    """Recursive descent over `_tokens(text)`: one method per production."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokens(text)
        self.at = 0

    def peek(self) -> _Token:
        return self.tokens[self.at]

    def take(self) -> _Token:
        token = self.tokens[self.at]
        self.at += 1
        return token

    def fail(self, token: _Token, expected: str) -> SelectorError:
        return SelectorError(
            self.text, token.position, f"expected {expected}, found {token.shown()}"
        )

    def selector(self) -> Selector:
        requirements = [self.requirement("a label key, '!KEY' or '*'")]
        while self.peek().kind == ",":
            self.take()
            requirements.append(self.requirement("a label key or '!KEY'"))
        if self.peek().kind != "end":
            raise self.fail(self.peek(), "',' or the end of the selector")
        return Selector(tuple(requirements))

    def requirement(self, expected: str) -> Requirement:
        if self.peek().kind == "!":
            self.take()
            return Requirement(self.key("a label key after '!'"), "!")
        key = self.key(expected)
        token = self.peek()
        if token.kind in (",", "end"):
            return Requirement(key, "exists")
        if token.kind in ("=", "==", "!="):
            self.take()
            return Requirement(key, "!=" if token.kind == "!=" else "=", (self.exact_value(),))
        if token.kind == "word" and token.text in _SET_OPS:
            self.take()
            return Requirement(key, "in" if token.text == "in" else "notin", self.value_set())
        raise self.fail(token, f"'=', '==', '!=', 'in' or 'notin' after key {key!r}, or ','")

    def key(self, expected: str) -> str:
        token = self.take()
        if token.kind != "word":
            raise self.fail(token, expected)
        if token.text == "*":
            raise SelectorError(self.text, token.position, "'*' (every machine) stands alone")
        problem = label_key_problem(token.text)
        if problem is not None:
            raise SelectorError(self.text, token.position, problem)
        return token.text

    def exact_value(self) -> str:
        if self.peek().kind in (",", "end"):
            return ""  # `env=`: the empty value, as in Kubernetes
        return self.value()

    def value_set(self) -> tuple[str, ...]:
        opening = self.take()
        if opening.kind != "(":
            raise self.fail(opening, "'(' to open the list of values")
        values = [self.value()]
        while self.peek().kind == ",":
            self.take()
            values.append(self.value())
        closing = self.take()
        if closing.kind != ")":
            raise self.fail(closing, "',' or ')' to close the list of values")
        return tuple(values)

    def value(self) -> str:
        token = self.take()
        if token.kind != "word":
            raise self.fail(token, "a label value")
        problem = label_value_problem(token.text)
        if problem is not None:
            raise SelectorError(self.text, token.position, problem)
        return token.text
