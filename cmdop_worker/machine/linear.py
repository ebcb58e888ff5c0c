"""Regular expressions over model input that run in linear time by construction.

Python's `re` backtracks: a pattern such as `(\\w+)\\s*\\(` searched over 40 KB of
letters takes quadratic time, and one command could stall a machine worker's gate for
tens of seconds. These patterns are compiled with RE2 (`google-re2`), whose automata
match in time linear in the text for any pattern; RE2 has no backreferences nor
lookaround, so callers compare groups themselves. A pattern RE2 cannot compile (the
`grep` tool's, which the model writes) raises `Unsupported` with RE2's reason.

Python's `\\w` and `\\s` are Unicode-aware, RE2's are ASCII: `WORD` and `SPACE` spell
Python's classes for RE2. Text is matched with lone surrogates (from JSON `\\ud800` or
surrogateescape decoding) read as U+FFFD, which no pattern here names. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import re2

WORD = r"\p{L}\p{N}_"  # inside a class: what Python's `\w` matches in a str
SPACE = r"\s\v\x1c-\x1f\x85\p{Z}"  # inside a class: what Python's `\s` matches in a str
_SURROGATES = re.compile("[\ud800-\udfff]")  # one class, no quantifier: linear in `re`
_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is reported to the caller, not on stderr


class Unsupported(ValueError):
    """A pattern RE2 cannot compile: bad syntax, or Perl's backreferences, lookaround, ..."""


class Linear:
    """One RE2 pattern, with the few `re` methods the gate uses."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        try:
            self._compiled: Any = re2.compile(pattern, _OPTIONS)
        except re2.error as exc:
            reason = exc.args[0] if exc.args else "cannot compile"
            if isinstance(reason, bytes):
                reason = reason.decode("utf-8", errors="replace")
            raise Unsupported(str(reason)) from None

    def search(self, text: str) -> bool:
        return self._compiled.search(_readable(text)) is not None

    def groups(self, text: str) -> Iterator[tuple[str, ...]]:
        """The groups of each non-overlapping match, left to right."""
        for match in self._compiled.finditer(_readable(text)):
            yield tuple(g or "" for g in match.groups())

    def split(self, text: str) -> list[str]:
        return list(self._compiled.split(_readable(text)))


def _readable(text: str) -> str:
    return _SURROGATES.sub("\ufffd", text) if _SURROGATES.search(text) else text
