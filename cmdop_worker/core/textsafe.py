"""Text made safe to show on a person's terminal: `terminal_safe`, and `json_safe`.

What `run`, `events`, `chat`, `machines`, `threads` and `approve` print, and what a
worker logs, comes in part from the model, a tool, a machine or Redis, and any of it
may be hostile. A terminal acts on
control characters: ESC and the 8-bit C1 introducers open sequences (CSI, OSC, DCS,
APC, SOS, PM) that set the window title, write the clipboard (OSC 52), hide a link's
target (OSC 8), move the cursor and erase lines, so that later text overwrites a real
line with a forged one. rich strips only a handful of them.

`terminal_safe` shows every such character as visible text instead, so no sequence
can start: no parser of sequences is needed (terminals disagree on where one ends).
Shown the same way: DEL; a carriage return not followed by a newline (it sends the
cursor back over its own line); the bidirectional overrides, embeddings, isolates and
marks that reorder what is shown without changing the text (Trojan Source); line and
paragraph separators; lone surrogates (they cannot be encoded); and the other
invisible format characters (zero-width space, word joiner, BOM, tag characters, soft
hyphen). Newlines, tabs and every printable character pass, accents, CJK and emoji
included; the zero-width joiner and non-joiner pass too, as emoji sequences and
scripts such as Persian need them.

How a character is shown: C0 controls and DEL as their Unicode Control Pictures, one
column each (ESC as ␛, BEL as ␇, CR as ␍, DEL as ␡); anything else as `<U+202E>`.

`json_safe` is for a JSON document printed to a terminal (JSON log lines): JSON
escapes C0 itself but passes DEL, C1, bidi and format characters as they are; it
writes each of these as a `\\uXXXX` escape, so the document stays valid and parses
to the same values. The CLI's `--json` output never passes here: it stays byte-exact.
`line_breaker` finds, and `one_line` shows, what may not stand in one line: the same
characters, newline and tab too (a name an approval was given by is one line).
Pure, no I/O; in the core, which every wing and `logs` may import.
"""

from __future__ import annotations

import re

# Cc, Cf, Cs, Zl and Zp of Unicode 14 (Python 3.11's unicodedata), less tab, newline,
# ZWNJ and ZWJ; `tests/unit/surfaces/test_screen.py` checks it against unicodedata.
_UNSAFE_CLASS = (
    "\x00-\x08\x0b-\x1f\x7f-\x9f"  # C0 less tab and newline, DEL, C1
    "\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f"
    "\ud800-\udfff\ufeff\ufff9-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U00013438\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f"
)
_UNSAFE = re.compile(f"[{_UNSAFE_CLASS}]")
# The same for ASCII text (most tool output): a class this small is scanned ten times
# faster than the whole one, whose astral ranges are tried one by one per character.
_UNSAFE_ASCII = re.compile("[\x00-\x08\x0b-\x1f\x7f]")
_CONTROL_PICTURES = {code: chr(0x2400 + code) for code in range(0x20)} | {0x7F: "\u2421"}
_UNSAFE_IN_LINE = re.compile(f"[\t\n{_UNSAFE_CLASS}]")
_LINE_PICTURES = {ord("\n"): "\u240a", ord("\t"): "\u2409"}


def shown_as(char: str) -> str:
    """How one unsafe character is written on the screen instead of itself."""
    code = ord(char)
    return _CONTROL_PICTURES.get(code) or f"<U+{code:04X}>"


def _replace(match: re.Match[str]) -> str:
    found = match.group()
    if found == "\r" and match.string.startswith("\n", match.end()):
        return ""  # a CRLF ends its line as a newline does
    return shown_as(found)


def terminal_safe(text: str) -> str:
    """`text` with every character a terminal would act on, or draw as nothing that
    changes what else is drawn, shown as visible text; newlines and tabs kept, a
    CRLF shown as a newline."""
    return (_UNSAFE_ASCII if text.isascii() else _UNSAFE).sub(_replace, text)


def line_breaker(text: str) -> str | None:
    """The first character of `text` that may not stand in one line of plain text (a
    name): every one `terminal_safe` would show as something else, and newline and
    tab too; None when there is none."""
    found = _UNSAFE_IN_LINE.search(text)
    return None if found is None else found.group()


def one_line(text: str) -> str:
    """`terminal_safe(text)` kept to one line: newlines and tabs shown as ␊ and ␉ too,
    so what a line shows after it cannot look like a line of its own."""
    return terminal_safe(text).translate(_LINE_PICTURES)


def json_safe(document: str) -> str:
    """A JSON document with every unsafe character written as a JSON escape.

    Such a character can only stand inside a string (JSON's own syntax is ASCII), where
    `\\uXXXX` (a surrogate pair beyond the BMP) means that same character."""
    if document.isascii() and not _UNSAFE_ASCII.search(document):
        return document
    return _UNSAFE.sub(_json_escape, document)


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
