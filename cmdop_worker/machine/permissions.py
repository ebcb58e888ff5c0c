"""Permission decisions for tool calls on a machine: pure functions over a `Policy`.

Order of decision (first match wins):

1. The hard floor (`floor`): `.env` files, `.git` internals, `.ssh`, `rm -rf /`,
   writes to `/etc/shadow`, fork bombs. Nothing passes it.
2. Rules `tool(argGlob)` or bare `tool`: deny beats ask beats allow. The glob
   (fnmatch: `*` also matches `/`) is tried on the call's subjects (`subjects`).
3. The mode default: default → ask, strict → deny, bypass → allow.

For execute_command the gate decides on the command's syntax tree (`shell.analyse`,
tree-sitter-bash), never on its raw text:

- Deny and ask rules are tried on every simple command found anywhere in the tree —
  inside subshells, groups, pipelines, `$(…)`, `bash -c '…'` — each as written and with
  every wrapper stripped (`env`, `sudo`, `nice`, `timeout`, `xargs`, …), its name also
  as a basename, so `\\reboot`, `'reboot'`, `/usr/sbin/reboot` and `env reboot` all meet
  `reboot*`; git also without its global options (`git --no-pager push` meets
  `git push*`), and a command xargs runs also with a placeholder for the words it
  appends (`xargs rm` meets `rm *` as `rm x`). When a command's name is computed
  (`$x`, `$(…)`), deny rules cannot be checked, so such a command is never let
  through by the mode: it is asked about.
- An allow rule admits a command only when every simple command, as written and as
  each wrapper runs it (`timeout 5 X` needs a rule for X too), matches an allow rule,
  and nothing in the tree can run code or name a file the rule did not see (the
  analysis's hazards: substitutions, expansions, assignments, `eval`, redirections
  to files, …). A bare `execute_command`, `execute_command(*)` or a
  rule for the exact command text admits the command whole.
- A command the parser cannot read cleanly is never allowed by a rule: it gets the
  mode's default.
- Programs that run code or write files through their options or scripts (`programs`:
  awk's program text, `sed e`, `git -c alias.x=!…`, `tar --checkpoint-action=exec=`,
  `find -exec`/`-fprint`/`-delete`, `sort -o`, pagers, editors, interpreters) are never
  admitted by an allow rule's glob, only by a rule for the exact command text. Code
  they run is hidden from deny and ask rules, so such a line is asked about even where
  the mode would allow it; shell code they run that can be read (`sed '1e CMD'`, a git
  alias `!CMD`) is parsed again, so a deny rule still meets `CMD`.
- A program named by a path the sandbox may have written (`progpath`: `/tmp/zz`,
  `./build.sh`, a path under a `writable` grant) is one no rule can know by name: an
  allow rule's glob never admits it, and where the mode would allow it while deny or
  ask rules are set, it is asked about.
- A command longer than `MAX_COMMAND_BYTES`, or holding more `|`, `(`, backquotes or
  `<<` than `MAX_OPERATORS` allows, is not read at all (`command_over_limits`).

Paths reach `decide` canonical (`paths.canonical_input`: `~`, `..`, `//` and symlinks
resolved), so a rule sees the path that will be touched. For grep and glob, a rule
whose glob is a path (starts with `/` or `~`) is matched on the search root, so an
operator can confine them to a tree; other rules match the pattern.

What the gate guarantees is what it decides; what a command may then do is held by
the sandbox (`sandbox`): a command let through by a rule runs with a read-only
filesystem. No I/O: `decide` reads no files, environment or clock.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cmdop_worker.machine.floor import floor_violation
from cmdop_worker.machine.gitopts import git_without_globals
from cmdop_worker.machine.policy import (
    MODE_VERDICT,
    Mode,
    Policy,
    Rule,
    SandboxPolicy,
    load_policy,
    parse_rule,
)
from cmdop_worker.machine.progpath import unknown_programs
from cmdop_worker.machine.shell import ShellAnalysis, SimpleCommand, analyse, rule_text

__all__ = [
    "MAX_COMMAND_BYTES",
    "MAX_OPERATORS",
    "MODE_VERDICT",
    "Decision",
    "Mode",
    "Policy",
    "Rule",
    "SandboxPolicy",
    "command_over_limits",
    "decide",
    "load_policy",
    "parse_rule",
    "primary_arg",
    "subjects",
]

Verdict = Literal["allow", "ask", "deny"]
DecisionSource = Literal["floor", "rule", "mode"]

PRIMARY_ARG: Mapping[str, str] = {
    "execute_command": "command",
    "read_file": "path",
    "write_file": "path",
    "list_dir": "path",
    "grep": "pattern",
    "glob": "pattern",
}
ROOTED_TOOLS = frozenset({"grep", "glob"})
# Longer than any command a person would write or read before approving it; the parse
# and every check after it are linear, this keeps their work per call small too.
MAX_COMMAND_BYTES = 64 * 1024
# tree-sitter's error recovery is quadratic in how many of these a broken line holds
# (64 KB of `ls | ` with no last command took seconds, holding the GIL); 1024 of each
# keeps it to milliseconds.
MAX_OPERATORS: Mapping[str, int] = {"|": 1024, "(": 1024, "`": 1024, "<<": 1024}


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    rule: str | None
    source: DecisionSource


def primary_arg(tool: str, args: Mapping[str, Any]) -> str:
    """The argument rules match on; "" for tools without one (bare rules still apply)."""
    value = args.get(PRIMARY_ARG.get(tool, ""), "")
    return value if isinstance(value, str) else str(value)


def subjects(tool: str, args: Mapping[str, Any]) -> tuple[str, ...]:
    """What deny and ask rules are tried on: the primary argument, and for grep and
    glob also the search root. A path is also tried as a directory (`/var/log/`), so
    a rule for a tree (`/var/log/*`) covers its root."""
    found = [primary_arg(tool, args)]
    root = args.get("path")
    if tool in ROOTED_TOOLS and isinstance(root, str):
        found.append(root)
    if tool in ROOTED_TOOLS or PRIMARY_ARG.get(tool) == "path":
        found += [path.rstrip("/") + "/" for path in found[-1:] if path.startswith("/")]
    return tuple(found)


def command_over_limits(tool: str, args: Mapping[str, Any]) -> str | None:
    """Why a command is refused unread: longer than `MAX_COMMAND_BYTES` in UTF-8, or
    holding more of an operator than `MAX_OPERATORS` allows."""
    command = args.get("command") if tool == "execute_command" else None
    if not isinstance(command, str):
        return None
    size = len(command) if command.isascii() else len(command.encode("utf-8", "surrogatepass"))
    if size > MAX_COMMAND_BYTES:
        return f"command is {size} bytes long; the most a machine reads is {MAX_COMMAND_BYTES}"
    for operator, limit in MAX_OPERATORS.items():
        count = command.count(operator)
        if count > limit:
            return f"command holds {count} {operator!r}; the most a machine reads is {limit}"
    return None


def decide(tool: str, args: Mapping[str, Any], policy: Policy) -> Decision:
    """Floor, then deny > ask > allow rules, then the mode default."""
    over_limits = command_over_limits(tool, args)
    if over_limits is not None:
        return Decision("deny", over_limits, None, "floor")
    parsed = analyse(args["command"]) if _is_command(tool, args) else None
    violation = floor_violation(tool, args, parsed)
    if violation is not None:
        return Decision("deny", f"protected by the hard floor: {violation}", None, "floor")
    candidates = _candidates(tool, args, parsed)
    rule = _first_matching(policy.deny, tool, candidates)
    if rule is not None:
        return Decision("deny", f"deny rule {rule!r} matches", rule, "rule")
    rule = _first_matching(policy.ask, tool, candidates)
    if rule is not None:
        return Decision("ask", f"ask rule {rule!r} matches", rule, "rule")
    unknown = _unknown(parsed, policy)
    rule = _allowing(policy.allow, tool, args, parsed, unknown)
    if rule is not None:
        return Decision("allow", f"allow rule {rule!r} matches", rule, "rule")
    return _mode_default(policy, parsed, unknown)


def _unknown(parsed: ShellAnalysis | None, policy: Policy) -> tuple[str, ...]:
    """Programs named by a path the sandbox may have written (`progpath`)."""
    if parsed is None:
        return ()
    words = (layer[0] for c in parsed.commands for layer in c.layers if layer)
    return unknown_programs(words, policy.sandbox.writable)


def _is_command(tool: str, args: Mapping[str, Any]) -> bool:
    return tool == "execute_command" and isinstance(args.get("command"), str)


def _candidates(
    tool: str, args: Mapping[str, Any], parsed: ShellAnalysis | None
) -> tuple[str, ...]:
    found = dict.fromkeys(subjects(tool, args))
    if parsed is not None:
        for command in parsed.commands:
            found.update(dict.fromkeys(command.texts()))
            found.update(dict.fromkeys(_unseen_forms(command)))
    return tuple(found)


def _unseen_forms(command: SimpleCommand) -> list[str]:
    """Forms of a command that deny and ask rules must also meet: git with its global
    options removed (`git --no-pager push` is a `git push`), and a layer xargs runs
    with a placeholder for the words it appends (`xargs rm` runs `rm x`)."""
    found, appended = [], False
    for layer in filter(None, command.layers):
        base = (posixpath.basename(layer[0]), *layer[1:])
        forms = [base]
        plain = git_without_globals(base[1:]) if base[0] == "git" else None
        forms += [("git", *plain)] if plain is not None else []
        found += [rule_text(f) for f in forms[1:]]
        found += [f"{rule_text(f)} x" for f in (layer, *forms)] if appended else []
        appended = appended or base[0] == "xargs"
    return found


def _first_matching(rules: Sequence[str], tool: str, candidates: Sequence[str]) -> str | None:
    for text in rules:
        rule = parse_rule(text)
        if any(rule.matches(tool, candidate) for candidate in candidates):
            return rule.text
    return None


def _allowing(
    rules: Sequence[str],
    tool: str,
    args: Mapping[str, Any],
    parsed: ShellAnalysis | None,
    unknown: Sequence[str] = (),
) -> str | None:
    parsed_rules = [parse_rule(text) for text in rules]
    if parsed is None:
        return _allowing_file_call(parsed_rules, tool, args)
    if parsed.parse_error:
        return None
    command = primary_arg(tool, args).strip()
    for rule in parsed_rules:
        if rule.matches(tool, command) and (rule.covers_whole_command or rule.arg_glob == command):
            return rule.text
    if parsed.hazards or parsed.runs_code or parsed.writes or unknown or not parsed.commands:
        return None
    covering = [_covering(parsed_rules, tool, c) for c in parsed.commands]
    if all(rules is not None for rules in covering):
        return " + ".join(
            dict.fromkeys(r for rules in covering if rules is not None for r in rules)
        )
    return None


def _covering(rules: Sequence[Rule], tool: str, command: SimpleCommand) -> list[str] | None:
    """The rules admitting each layer of `command` as written: a rule for a wrapper
    (`env *`, `timeout *`, `xargs *`) does not admit the command it runs. Words that
    xargs appends are unseen, so a layer it runs must be admitted with a word added."""
    found, appended = [], False
    for layer in command.layers:
        text = rule_text(layer)
        tries = (text, f"{text} x") if appended else (text,)
        rule = next((r for r in rules if any(r.matches(tool, t) for t in tries)), None)
        if rule is None:
            return None
        found.append(rule.text)
        appended = appended or posixpath.basename(layer[0]) == "xargs"
    return found


def _allowing_file_call(rules: Sequence[Rule], tool: str, args: Mapping[str, Any]) -> str | None:
    primary, root = primary_arg(tool, args), args.get("path")
    path = root if tool in ROOTED_TOOLS else primary
    for rule in rules:
        if rule.is_path_rule or tool not in ROOTED_TOOLS:
            tried = (path, path.rstrip("/") + "/") if isinstance(path, str) else ("",)
        else:
            tried = (primary,)
        if any(rule.matches(tool, subject) for subject in tried):
            return rule.text
    return None


def _mode_default(
    policy: Policy, parsed: ShellAnalysis | None, unknown: Sequence[str] = ()
) -> Decision:
    verdict = MODE_VERDICT[policy.mode]
    found = (*parsed.runs_code, *parsed.writes) if parsed is not None else ()
    found += tuple(f"{p:.60} is a program at a path the sandbox may write" for p in unknown)
    why = f" ({found[0]}: no allow rule's glob admits that)" if found else ""
    checks = policy.deny or policy.ask
    if verdict == "allow" and checks and parsed is not None and (_opaque(parsed) or unknown):
        return Decision(
            "ask",
            f"no rule matches; mode {policy.mode!r} would allow, but deny and ask rules "
            "cannot be checked on a line that is unreadable, computes a command or runs "
            f"hidden code{why}",
            None,
            "mode",
        )
    reason = f"no rule matches; mode {policy.mode!r} means {verdict}{why}"
    return Decision(verdict, reason, None, "mode")


def _opaque(parsed: ShellAnalysis) -> bool:
    """Whether deny and ask rules may miss what the line runs: it is unreadable, a
    command name is computed, or anything in it runs code the rules do not see (a shell
    reading stdin, `((x))` over a planted subscript, an unknown wrapper option, awk's
    program text, a pager, `xargs sh -c`, …)."""
    hidden = parsed.parse_error or bool(parsed.hazards) or bool(parsed.runs_code)
    return hidden or any(not c.literal for c in parsed.commands)
