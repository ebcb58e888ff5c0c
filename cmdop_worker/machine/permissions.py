"""Permission decisions for tool calls on a machine: pure functions over a `Policy`.

Order of decision (first match wins):

1. The hard floor: `.env` files, `.git` internals, `.ssh`, `rm -rf /`,
   writes to `/etc/shadow`, fork bombs. Nothing passes it: not mode "bypass", not an
   allow rule, and a policy has no switch to turn it off.
2. Rules `tool(argGlob)` or bare `tool`: deny beats ask beats allow. The glob
   (fnmatch: `*` also matches `/`) is tried on the call's primary argument: `command`
   for execute_command, `path` for the file tools, `pattern` for grep and glob.
3. The mode default: default → ask, strict → deny, bypass → allow.

For execute_command, deny and ask rules match the whole command or any of its
`;`/`&&`/`||`/`|`/`&` parts, while an allow rule must cover every part, and a command
with `$(…)`, backticks or a redirection into a file is allowed only by a rule for
the whole command (bare, `*`, or wildcard-free), so `git status; rm -rf ~` cannot ride on
`execute_command(git status*)`.

The floor is a guard against accidents, not a sandbox: it reads the command text
with regexes (erring towards refusing) and cannot see through variables, scripts,
symlinks or relative paths resolved from an unknown directory.

No I/O: `decide` reads no files, environment or clock. The worker loads TOML and
calls `load_policy(data)`; who asks a person and writes the audit line is the caller.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

Verdict = Literal["allow", "ask", "deny"]
Mode = Literal["default", "strict", "bypass"]
DecisionSource = Literal["floor", "rule", "mode"]

MODE_VERDICT: Mapping[str, Verdict] = {"default": "ask", "strict": "deny", "bypass": "allow"}
PRIMARY_ARG: Mapping[str, str] = {
    "execute_command": "command",
    "read_file": "path",
    "write_file": "path",
    "list_dir": "path",
    "grep": "pattern",
    "glob": "pattern",
}

_RULE = re.compile(r"^\s*([A-Za-z0-9_*?.\-\[\]]+)\s*(?:\((.*)\))?\s*$", re.DOTALL)
# `&` separates commands except inside redirections such as `2>&1` and `&>file`.
_SEPARATORS = re.compile(r"&&|\|\||[;|\n]|(?<![<>])&(?!>)")
# Stripped before deny/ask rules look at a part, so `sudo reboot` meets `reboot*`.
_WRAPPERS = re.compile(r"^(?:(?:sudo|doas|nohup|exec|time|nice|command)(?:\s+-\S+)*\s+)+")
_UNSAFE_FOR_ALLOW = re.compile(r"\$\(|`|<\(|>\(|>(?!&\d|\s*/dev/null)")


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    rule: str | None
    source: DecisionSource


@dataclass(frozen=True)
class Rule:
    """One parsed `tool(argGlob)`; `arg_glob` None means any argument."""

    text: str
    tool_glob: str
    arg_glob: str | None

    def matches(self, tool: str, primary: str) -> bool:
        if not fnmatch.fnmatchcase(tool, self.tool_glob):
            return False
        return self.arg_glob is None or fnmatch.fnmatchcase(primary, self.arg_glob)

    @property
    def covers_whole_command(self) -> bool:
        """Bare, `*`, or wildcard-free: may allow a compound command as a whole."""
        glob = self.arg_glob
        return glob is None or glob.strip() in ("*", "**") or not any(c in glob for c in "*?[")


@lru_cache(maxsize=1024)
def parse_rule(text: str) -> Rule:
    """`execute_command(git status*)`, `read_file(/var/log/**)` or a bare `list_dir`."""
    match = _RULE.match(text)
    if match is None:
        raise ValueError(f"bad permission rule {text!r}: expected tool or tool(argGlob)")
    tool_glob, arg_glob = match.group(1), match.group(2)
    if arg_glob is not None and not arg_glob.strip():
        raise ValueError(f"bad permission rule {text!r}: empty argument glob")
    return Rule(text=text.strip(), tool_glob=tool_glob, arg_glob=arg_glob)


@dataclass(frozen=True)
class Policy:
    mode: Mode = "default"
    allow: tuple[str, ...] = ()
    ask: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODE_VERDICT:
            raise ValueError(f"unknown permission mode {self.mode!r}")
        for text in (*self.allow, *self.ask, *self.deny):
            parse_rule(text)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Policy:
        """From TOML data: `{"mode": "default", "rules": {"allow": [...], ...}}`."""
        try:
            parsed = _PolicyFile.model_validate(dict(data))
        except ValidationError as exc:
            raise ValueError(f"invalid permission policy: {exc}") from exc
        rules = parsed.rules
        return cls(mode=parsed.mode, allow=rules.allow, ask=rules.ask, deny=rules.deny)


class _Rules(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    allow: tuple[str, ...] = ()
    ask: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()


class _PolicyFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: Mode = "default"
    rules: _Rules = _Rules()


def load_policy(data: Mapping[str, Any], *, mode: Mode | None = None) -> Policy:
    """The policy from loaded TOML data; `mode`, when given, overrides the file's."""
    policy = Policy.from_mapping(data)
    if mode is None:
        return policy
    return Policy(mode=mode, allow=policy.allow, ask=policy.ask, deny=policy.deny)


def primary_arg(tool: str, args: Mapping[str, Any]) -> str:
    """The argument rules match on; "" for tools without one (bare rules still apply)."""
    value = args.get(PRIMARY_ARG.get(tool, ""), "")
    return value if isinstance(value, str) else str(value)


def decide(tool: str, args: Mapping[str, Any], policy: Policy) -> Decision:
    """Floor, then deny > ask > allow rules, then the mode default."""
    violation = floor_violation(tool, args)
    if violation is not None:
        return Decision("deny", f"protected by the hard floor: {violation}", None, "floor")
    primary = primary_arg(tool, args)
    rule = _first_blocking(policy.deny, tool, primary)
    if rule is not None:
        return Decision("deny", f"deny rule {rule!r} matches", rule, "rule")
    rule = _first_blocking(policy.ask, tool, primary)
    if rule is not None:
        return Decision("ask", f"ask rule {rule!r} matches", rule, "rule")
    rule = _first_allowing(policy.allow, tool, primary)
    if rule is not None:
        return Decision("allow", f"allow rule {rule!r} matches", rule, "rule")
    verdict = MODE_VERDICT[policy.mode]
    return Decision(verdict, f"no rule matches; mode {policy.mode!r} means {verdict}", None, "mode")


def command_parts(command: str) -> list[str]:
    """The simple commands of a command line, split on ; && || | & and newlines."""
    return [part.strip() for part in _SEPARATORS.split(command) if part.strip()]


def _first_blocking(rules: Sequence[str], tool: str, primary: str) -> str | None:
    candidates = [primary]
    if tool == "execute_command":
        parts = command_parts(primary)
        candidates += parts + [_WRAPPERS.sub("", part) for part in parts]
    for text in rules:
        rule = parse_rule(text)
        if any(rule.matches(tool, candidate) for candidate in candidates):
            return rule.text
    return None


def _first_allowing(rules: Sequence[str], tool: str, primary: str) -> str | None:
    parsed = [parse_rule(text) for text in rules]
    for rule in parsed:
        if rule.matches(tool, primary) and (tool != "execute_command" or rule.covers_whole_command):
            return rule.text
    if tool != "execute_command" or _UNSAFE_FOR_ALLOW.search(primary):
        return None
    parts = command_parts(primary) or [primary]
    covering = [next((r for r in parsed if r.matches(tool, p)), None) for p in parts]
    if all(rule is not None for rule in covering):
        return " + ".join(dict.fromkeys(rule.text for rule in covering if rule is not None))
    return None


# --- the hard floor -------------------------------------------------------------

_B = r"""(?:^|(?<=[\s/'"=:<>|;&(){}`,]))"""  # a path component starts here
_E = r"""(?=$|[\s/'"<>|;&(){}`,])"""  # ... and ends here
_COMMAND_FLOOR: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(_B + r"\.env(?:\.[^\s/'\"<>|;&(){}`,]*)?" + _E), ".env files"),
    (re.compile(_B + r"\.git" + _E), ".git internals"),
    (re.compile(_B + r"\.ssh" + _E), "~/.ssh"),
    (
        re.compile(r"(?P<f>[A-Za-z_:][\w:.-]*)\s*\(\s*\)\s*\{\s*(?P=f)\s*\|\s*(?P=f)\s*&"),
        "fork bomb",
    ),
    (re.compile(r"\bfunction\s+(?P<f>[\w:.-]+)[\s()]*\{\s*(?P=f)\s*\|\s*(?P=f)\s*&"), "fork bomb"),
)
_FLOOR_SPLIT = re.compile(r"\$\(|&&|\|\||[;&|\n(){}`]")
_SHADOW = re.compile(r"/etc/g?shadow-?(?![\w.-])")
_WRITES = re.compile(r">|\b(?:tee|cp|mv|install|dd|sed|perl|truncate|ln|rsync|chpasswd)\b")
_SHADOW_PATHS = frozenset({"shadow", "shadow-", "gshadow", "gshadow-"})
_WRITING_TOOLS = frozenset({"write_file"})


def floor_violation(tool: str, args: Mapping[str, Any]) -> str | None:
    """What the call touches that nothing may allow, or None."""
    path = args.get("path")
    if isinstance(path, str):
        found = protected_path_reason(path) or _shadow_write(tool, path)
        if found:
            return f"{found} (path {path!r})"
    pattern = args.get("pattern")
    if tool == "glob" and isinstance(pattern, str) and protected_path_reason(pattern):
        return f"{protected_path_reason(pattern)} (pattern {pattern!r})"
    command = args.get("command")
    if isinstance(command, str):
        return command_floor_reason(command)
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


def command_floor_reason(command: str) -> str | None:
    for pattern, reason in _COMMAND_FLOOR:
        if pattern.search(command):
            return reason
    for part in _FLOOR_SPLIT.split(command):
        if _is_rm_root(part):
            return "rm -rf /"
        if _SHADOW.search(part) and _WRITES.search(part):
            return "writes to /etc/shadow"
    return None


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
