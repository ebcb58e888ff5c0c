"""The hard floor: what no policy, mode or person's approval lets a tool call touch.

`.env` / `.env.*` files, anything inside `.git`, `~/.ssh`, `rm -rf /` and its variants,
writes to `/etc/shadow`, fork bombs. Nothing passes it: not mode "bypass", not an allow
rule, and a policy has no switch to turn it off.

It is a guard against accidents, read two ways and erring towards refusing: regexes
over the command text (which also catch what a variable or a quote would hide from a
parser), and the parsed simple commands of `shell.analyse` (so `\rm -rf /`,
`sudo /bin/rm -R /` and `bash -c 'rm -rf /*'` meet the `rm` check with their wrappers
stripped). File tools reach it with canonical paths (`paths.canonical_input`), so a
symlink into `~/.ssh` is seen as `~/.ssh`. The sandbox, not the floor, is what holds a
command to the policy (`sandbox`).

Pure: called by `permissions.decide` before any rule.
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Mapping
from typing import Any

from cmdop_worker.machine.linear import SPACE, WORD, Linear
from cmdop_worker.machine.shell import ShellAnalysis, analyse, rm_root_targets

_DELIMS = r"""/'"<>|;&(){}`,"""
_B = rf"(?:^|[{SPACE}{_DELIMS}=:])"  # a path component starts here
_E = rf"(?:$|[{SPACE}{_DELIMS}])"  # ... and ends here
_NAME = rf"[{WORD}:.-]"
_COMMAND_FLOOR: tuple[tuple[Linear, str], ...] = (
    (Linear(_B + rf"\.env(?:\.[^{SPACE}{_DELIMS}]*)?" + _E), ".env files"),
    (Linear(_B + r"\.git" + _E), ".git internals"),
    (Linear(_B + r"\.ssh" + _E), "~/.ssh"),
)
# `f(){ f|f& }`: the three names are compared after the match (RE2 has no
# backreferences); the defined name may be the tail of a longer word, as bash reads it.
_S = rf"[{SPACE}]*"
_BOMB = Linear(rf"([A-Za-z_:]{_NAME}*){_S}\({_S}\){_S}\{{{_S}({_NAME}+){_S}\|{_S}({_NAME}+){_S}&")
_FUNCTION_BOMB = Linear(
    rf"\bfunction[{SPACE}]+({_NAME}+)[{SPACE}()]*\{{{_S}({_NAME}+){_S}\|{_S}({_NAME}+){_S}&"
)
_FLOOR_SPLIT = Linear(r"\$\(|&&|\|\||[;&|\n(){}`]")
_SHADOW = Linear(rf"/etc/g?shadow-?(?:$|[^{WORD}.-])")
_WRITES = Linear(r">|\b(?:tee|cp|mv|install|dd|sed|perl|truncate|ln|rsync|chpasswd)\b")
_SHADOW_PATHS = frozenset({"shadow", "shadow-", "gshadow", "gshadow-"})
_WRITING_TOOLS = frozenset({"write_file"})


def floor_violation(
    tool: str, args: Mapping[str, Any], parsed: ShellAnalysis | None = None
) -> str | None:
    """What the call touches that nothing may allow, or None; `parsed` is the command's
    analysis when the caller has it already."""
    path = args.get("path")
    if isinstance(path, str):
        found = protected_path_reason(path) or _shadow_write(tool, path) or _process_file(path)
        if found:
            return f"{found} (path {path!r})"
    pattern = args.get("pattern")
    if tool == "glob" and isinstance(pattern, str) and protected_path_reason(pattern):
        return f"{protected_path_reason(pattern)} (pattern {pattern!r})"
    command = args.get("command")
    if isinstance(command, str):
        return command_floor_reason(command, parsed)
    return None


def protected_path_reason(path: str) -> str | None:
    """Why a path is behind the floor: a `.env`/`.env.*` name, `.git` or `.ssh` in it."""
    parts = set(path.split("/")) | set(posixpath.normpath(path).split("/"))
    if ".git" in parts:
        return ".git internals"
    if ".ssh" in parts:
        return "~/.ssh"
    if any(part == ".env" or part.startswith(".env.") for part in parts):
        return ".env files"
    return None


def command_floor_reason(command: str, parsed: ShellAnalysis | None = None) -> str | None:
    parsed = parsed if parsed is not None else analyse(command)
    if any(rm_root_targets(cmd) for cmd in parsed.commands):
        return "rm -rf /"
    for word in (word for cmd in parsed.commands for word in cmd.words):
        reason = protected_path_reason(word) or glob_reach_reason(word)
        if reason:
            return reason
    for pattern, reason in _COMMAND_FLOOR:
        if pattern.search(command):
            return reason
    if _fork_bomb(command):
        return "fork bomb"
    for part in _FLOOR_SPLIT.split(command):
        if _is_rm_root(part):
            return "rm -rf /"
        if _SHADOW.search(part) and _WRITES.search(part):
            return "writes to /etc/shadow"
    return None


_PROTECTED_NAMES = (".env", ".env.local", ".git", ".ssh")


def glob_reach_reason(word: str) -> str | None:
    """Why a glob in a word could expand to a protected name (`.en?`, `.gi*`, `.ss[h]`):
    bash matches a leading dot only when the pattern spells it, so only such parts."""
    for part in word.split("/"):
        if part.startswith(".") and any(c in part for c in "*?["):
            hit = next((n for n in _PROTECTED_NAMES if fnmatch.fnmatchcase(n, part)), None)
            if hit is not None:
                return protected_path_reason(hit)
    return None


_PROCESS_DIR = Linear(r"^/proc/(?:[0-9]+|self|thread-self)(?:/|$)")


def _process_file(path: str) -> str | None:
    """File tools run in the worker itself, outside the sandbox: its `/proc/<pid>/`
    (environ, mem, cmdline, fds) holds what it started with, secrets included, whatever
    the worker later scrubbed. `/proc/meminfo` and the like stay readable."""
    if _PROCESS_DIR.search(path):
        return "process files under /proc (the worker's environment and memory)"
    return None


def _fork_bomb(command: str) -> bool:
    """`name(){ name|name& }` or `function name { name|name& }`, however spaced."""
    for defined, left, right in _BOMB.groups(command):
        if left == right and defined.endswith(left) and left[:1] in _NAME_START:
            return True
    return any(a == b == c for a, b, c in _FUNCTION_BOMB.groups(command))


_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")


def _shadow_write(tool: str, path: str) -> str | None:
    tail = posixpath.normpath(path).split("/")[-2:]
    if tool in _WRITING_TOOLS and tail[0] == "etc" and tail[-1] in _SHADOW_PATHS:
        return "writes to /etc/shadow"
    return None


def _is_rm_root(part: str) -> bool:
    """`rm -rf /`, `rm -fr /*`, `rm -r -f /`, `sudo /bin/rm -R /`, `--no-preserve-root`."""
    tokens = part.replace('"', " ").replace("'", " ").split()
    starts = [i for i, token in enumerate(tokens) if posixpath.basename(token) == "rm"]
    if not starts:
        return False
    rest = tokens[starts[0] + 1 :]
    if "--no-preserve-root" in rest:
        return True
    recursive = any(_is_recursive_flag(token) for token in rest)
    targets = [token for token in rest if not token.startswith("-")]
    return recursive and any(_is_root(token) for token in targets)


def _is_recursive_flag(token: str) -> bool:
    if token == "--recursive":
        return True
    return token.startswith("-") and not token.startswith("--") and bool(set(token) & {"r", "R"})


def _is_root(target: str) -> bool:
    return target.startswith("/") and target.strip("/") in ("", "*", ".", ".*")
