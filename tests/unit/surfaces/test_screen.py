"""Text from the fleet on a terminal: every control shown as text, printable text kept;
and every field of every event the live and chat views show goes through it."""

from __future__ import annotations

import io
import json
import re
import unicodedata

import pytest
from rich.console import Console

from cmdop_worker.models import Event
from cmdop_worker.surfaces.chat import ChatView
from cmdop_worker.surfaces.render import JsonView, LiveView
from cmdop_worker.surfaces.screen import safe_markup, shown_as, terminal_safe

ESC = "\x1b"


@pytest.mark.parametrize(
    ("hostile", "shown"),
    [
        ("\x1b]0;PWNED\x07", "␛]0;PWNED␇"),  # OSC 0: window title, BEL-terminated
        ("\x1b]2;PWNED\x1b\\", "␛]2;PWNED␛\\"),  # OSC 2, ST-terminated
        ("\x1b]52;c;Y3VybA==\x07", "␛]52;c;Y3VybA==␇"),  # OSC 52: the clipboard
        ("\x1b]8;;http://x/\x1b\\a\x1b]8;;\x1b\\", "␛]8;;http://x/␛\\a␛]8;;␛\\"),  # OSC 8 link
        ("\x1b[2K\x1b[1G✓ ok", "␛[2K␛[1G✓ ok"),  # CSI: erase the line, column 1
        ("\x1b[1A\x1b[H\x1b[2J", "␛[1A␛[H␛[2J"),  # CSI: cursor up, home, clear screen
        ("\x1b[8mhidden\x1b[0m", "␛[8mhidden␛[0m"),  # SGR conceal
        ("\x1bPq#0\x1b\\", "␛Pq#0␛\\"),  # DCS (sixel)
        ("\x1b_title\x1b\\", "␛_title␛\\"),  # APC
        ("\x1bXsos\x1b\\", "␛Xsos␛\\"),  # SOS
        ("\x1b^pm\x1b\\", "␛^pm␛\\"),  # PM
        ("\x1bkname\x1b\\", "␛kname␛\\"),  # screen's window name
        ("\x1bc", "␛c"),  # RIS: reset the terminal
        ("\x9b2K", "<U+009B>2K"),  # 8-bit CSI
        ("\x9d0;t\x9c", "<U+009D>0;t<U+009C>"),  # 8-bit OSC and ST
        ("\x90q\x9c", "<U+0090>q<U+009C>"),  # 8-bit DCS
        ("\x9f_\x9e^\x98X", "<U+009F>_<U+009E>^<U+0098>X"),  # 8-bit APC, PM, SOS
        ("\x85next", "<U+0085>next"),  # NEL
        ("real\r✓ forged", "real␍✓ forged"),  # a bare CR overwrites its own line
        ("ab\b\bXY", "ab␈␈XY"),  # backspace overwrites too
        ("ding\x07", "ding␇"),
        ("nul\x00", "nul␀"),
        ("del\x7f", "del␡"),
        ("vt\x0bff\x0c", "vt␋ff␌"),
        ("if admin\u202e }\u2066 {", "if admin<U+202E> }<U+2066> {"),  # Trojan Source
        (
            "\u202a\u202b\u202c\u202d\u2067\u2068\u2069",
            "<U+202A><U+202B><U+202C><U+202D><U+2067><U+2068><U+2069>",
        ),
        ("\u200e\u200f\u061c", "<U+200E><U+200F><U+061C>"),  # directional marks
        ("zero\u200bwidth\u2060\ufeff", "zero<U+200B>width<U+2060><U+FEFF>"),
        ("line\u2028para\u2029", "line<U+2028>para<U+2029>"),
        ("tag\U000e0041\U000e0042", "tag<U+E0041><U+E0042>"),  # ASCII smuggling
        ("lone \ud800", "lone <U+D800>"),  # a lone surrogate cannot even be encoded
    ],
)
def test_controls_are_shown_as_text(hostile: str, shown: str) -> None:
    safe = terminal_safe(hostile)
    assert safe == shown
    assert safe.encode("utf-8")  # printable on a UTF-8 terminal, surrogates included


@pytest.mark.parametrize(
    "kept",
    [
        "plain ascii, with [brackets] and back\\slashes",
        "lines\nand\ttabs\n",
        "café naïve Ünïcödé",
        "日本語のテキスト、全角",
        "русский текст",
        "עברית ومرحبا",  # right-to-left scripts without overrides are text
        "emoji 🚀 👍🏽 👩‍👩‍👧 🏳️‍🌈",  # skin tone, ZWJ family, flag with variation selector
        "ZWNJ in Persian: می‌خواهم",
        "box drawing ─│┌ and ␛ the picture itself",
    ],
)
def test_printable_text_newlines_and_tabs_pass(kept: str) -> None:
    assert terminal_safe(kept) == kept


def test_crlf_is_a_newline() -> None:
    assert terminal_safe("a\r\nb\r\n") == "a\nb\n"
    assert terminal_safe("a\r\rb") == "a␍␍b"


def test_every_control_and_format_character_is_shown_as_text() -> None:
    """The table in `screen` against this Python's unicodedata: every character of the
    categories Cc, Cf, Cs, Zl and Zp (less tab, newline, ZWNJ and ZWJ) is replaced."""
    kept = {"\t", "\n", "\u200c", "\u200d"}
    unsafe = [
        chr(code)
        for code in range(0x110000)
        if unicodedata.category(chr(code)) in ("Cc", "Cf", "Cs", "Zl", "Zp")
        and chr(code) not in kept
    ]
    assert len(unsafe) > 2000
    missed = [f"U+{ord(c):04X}" for c in unsafe if terminal_safe(c) != shown_as(c)]
    assert missed == []


def test_no_escape_introducer_survives_any_character() -> None:
    everything = "".join(chr(code) for code in range(0x110000))
    safe = terminal_safe(everything)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", safe)


def test_safe_markup_escapes_markup_too() -> None:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    reason = "[bold]keep[/] [link=x]\x1b]0;t\x07"
    console.print(f"reason: {safe_markup(reason)}")
    assert console.file.getvalue() == "reason: [bold]keep[/] [link=x]␛]0;t␇\n"  # type: ignore[attr-defined]


HOSTILE = "\x1b]0;T\x07\x1b]52;c;Y3VybA==\x07\x1b[2K\x1b[1G✓ forged\r\x9b2K\u202e[b]x[/b]"


def _events(hostile: str) -> list[Event]:
    """One event of every type the views show, every string it carries hostile."""
    usage = {"input_tokens": 1, "output_tokens": 2}
    call = {"tool_call_id": hostile, "tool": hostile, "machine": hostile}
    data = [
        ("TOKEN", {"text": hostile}),
        ("TOOL_START", {**call, "input": {"command": hostile, hostile: hostile}}),
        ("TOOL_END", {**call, "is_error": False, "output": hostile, "duration_ms": 5}),
        (
            "TOOL_END",
            {**call, "is_error": True, "output": f"exit_code: 0\n{hostile}", "duration_ms": 5},
        ),
        ("RETRY", {"attempt": 1, "delay_ms": 20, "cause": hostile}),
        (
            "APPROVAL_REQUEST",
            {
                **call,
                "input": {"command": hostile},
                "reason": hostile,
                "timeout_s": 5,
                "resolved_input": {"path": hostile},
            },
        ),
        (
            "APPROVAL_RESOLVED",
            {
                "tool_call_id": hostile,
                "verdict": "approved",
                "by": hostile,
                "reason": hostile,
                "input": {"command": hostile},
            },
        ),
        ("STEERED", {"text": hostile}),
        ("ERROR", {"kind": hostile, "message": hostile}),
        (
            "CANCELLED",
            {"channel": "ui", "reason": hostile, "partial_text": hostile, "usage": usage},
        ),
        ("DONE", {"text": hostile, "usage": usage, "turns": 1, "stop_reason": "end_turn"}),
    ]
    return [
        Event(run_id="r1", seq=seq, type=kind, turn=1, ts_ms=1000 + seq, data=fields)  # type: ignore[arg-type]
        for seq, (kind, fields) in enumerate(data, start=1)
    ]


@pytest.mark.parametrize("view_class", [LiveView, ChatView])
def test_the_views_send_no_control_but_their_own_colours(view_class: type[LiveView]) -> None:
    out = io.StringIO()
    console = Console(file=out, width=300, force_terminal=True, color_system="truecolor")
    view = view_class(console)
    for event in _events(HOSTILE):
        view.show(event)
        if event.type == "DONE":  # a second DONE, not after tokens: its text is printed
            view.in_text = False
            view.show(event)
    view.close()
    printed = out.getvalue()
    for raw in ("\x1b]", "\x07", "\x1b[1G", "forged\r", "\x9b", "\u202e"):
        assert raw not in printed
    # rich's own: colours, and the live block's cursor hiding and redrawing
    own = re.sub(r"\x1b\[[0-9;]*m|\x1b\[\?25[lh]|\x1b\[2K|\x1b\[\d*A|\r", "", printed)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", own), own
    assert "␛]0;T␇" in own and "<U+009B>2K" in own and "<U+202E>[b]x[/b]" in own
    assert "✓ forged␍" in own


def test_json_view_is_byte_exact_and_json_escapes_c0() -> None:
    out = io.StringIO()
    events = _events(HOSTILE)
    view = JsonView(out, io.StringIO())
    for event in events:
        view.show(event)
    lines = out.getvalue().splitlines()
    assert [Event.model_validate_json(line) for line in lines] == events  # byte-exact values
    assert ESC not in out.getvalue() and "\\u001b" in out.getvalue()  # JSON escapes C0
    # C1 and bidi characters are not JSON's to escape: a JSON reader gets them as sent.
    assert "\x9b" in out.getvalue() and "\u202e" in out.getvalue()
    assert json.loads(lines[0])["data"]["text"] == HOSTILE
