"""What the gateway reads from a request, parsed strictly: every malformed input is a
`BadInput` naming what is wrong (the gateway answers 422), never an exception that
reaches the server as a 500.

- `seq`: a `Last-Event-ID` or `?after=`: ASCII digits only, at most 20 (`str.isdigit`
  also takes '²' and '٣', which `int` refuses).
- `json_object`: a request body: UTF-8; JSON, without NaN or Infinity (other readers
  refuse them) nor a number so large it reads as infinite; an object, nested at most
  `MAX_DEPTH` deep; no integer longer than Python converts (4,300 digits); no unpaired
  surrogate (Redis stores UTF-8: it could not be written). Python's parser recurses,
  so a body about 1,000 levels deep fails it with a RecursionError: refused as too deep.
- `selector`: `?selector=` of `/v1/machines`, a label selector (`core.selectors`);
  absent, every machine.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable
from typing import Any

from cmdop_worker.core.selectors import EVERY, Selector, SelectorError, parse_selector

MAX_DEPTH = 64
MAX_SEQ_DIGITS = 20
_SEQ = re.compile(rf"[0-9]{{1,{MAX_SEQ_DIGITS}}}")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Valid UTF-8 holds no surrogate: one can only come from a `\uD800`-`\uDFFF` escape.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class BadInput(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def seq(raw: str, name: str) -> int:
    """The seq a reader resumes after; `name` says where it came from."""
    text = raw.strip(" \t")
    if not _SEQ.fullmatch(text):
        shown = ascii(raw[:40])[1:-1]
        if text.isascii() and text.isdigit():
            why = f"more than {MAX_SEQ_DIGITS} digits"
        else:
            why = "not a seq: ASCII digits, a whole number >= 0"
        raise BadInput(f"{name}: '{shown}' is {why}")
    return int(text)


def selector(raw: str | None) -> Selector:
    """The machines a `?selector=` names; every machine when there is none."""
    if raw is None:
        return EVERY
    try:
        return parse_selector(raw)
    except SelectorError as exc:
        raise BadInput(f"selector: {exc}") from None


def _constant(name: str) -> Any:
    raise BadInput(f"body: {name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise BadInput(f"body: the number {text[:40]} is out of range")
    return value


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object ({} when empty)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"body: not UTF-8 (byte {exc.start}: {exc.reason})") from None
    if not text.strip():
        return {}
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_float)
    except RecursionError:
        raise BadInput(f"body: nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise BadInput(f"body: not JSON ({exc})") from None
    except ValueError:  # an integer past Python's digit limit for int()
        limit = sys.get_int_max_str_digits()
        raise BadInput(f"body: a number has more than {limit} digits") from None
    texts = _SURROGATE_ESCAPE.search(text) is not None
    deep = text.count("[") + text.count("{") > MAX_DEPTH  # else it cannot be too deep
    if isinstance(value, (dict, list)) and (texts or deep):
        _check(value, texts=texts)
    if not isinstance(value, dict):
        raise BadInput(f"body: expected a JSON object, not {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _check(value: dict[str, Any] | list[Any], *, texts: bool) -> None:
    """Depth, and strings when `texts`, iteratively: the value may be a few hundred
    levels deep."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadInput(f"body: nested deeper than {MAX_DEPTH} levels")
        for item in _children(node, texts):
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
            elif texts and isinstance(item, str):
                _text(item)


def _children(node: dict[str, Any] | list[Any], texts: bool) -> Iterable[Any]:
    if isinstance(node, list):
        return node
    if texts:
        for key in node:
            _text(key)
    return node.values()


def _text(value: str) -> None:
    found = _SURROGATE.search(value)
    if found is not None:
        raise BadInput(f"body: a string holds an unpaired surrogate ({found.group()!a})")
