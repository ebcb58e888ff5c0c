"""What a bash command line runs, read with tree-sitter-bash, for the permission gate.

`analyse` finds every simple command in a line (code strings of `bash -c`, `eval`, `su -c`
parsed again), its argv as each wrapper (`sudo`, `env`, `nice -n 5`) is stripped, and the
hazards: whatever can run code or name a file a rule's text does not show. Called by
`machine.permissions`, with `rm_root_targets` for its floor; imports nothing of ours.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import takewhile

import tree_sitter_bash
from tree_sitter import Language, Node, Parser

MAX_DEPTH = 5  # how deep `bash -c "eval 'sh -c …'"` strings are parsed again
_LANGUAGE = Language(tree_sitter_bash.language())
Args = tuple[str, ...]


@dataclass(frozen=True)
class SimpleCommand:
    """One simple command: its argv, and the argv left after each wrapper is stripped."""

    words: tuple[str, ...]
    literal: bool
    layers: tuple[tuple[str, ...], ...]

    @property
    def name(self) -> str:
        return posixpath.basename(self.layers[-1][0]) if self.layers and self.layers[-1] else ""

    def texts(self) -> tuple[str, ...]:
        """Each layer shell-quoted, also with argv[0] as its basename, for rule globs."""
        found: dict[str, None] = {}
        for argv in filter(None, self.layers):
            base = (posixpath.basename(argv[0]), *argv[1:])
            found[shlex.join(argv)] = found[shlex.join(base)] = None
        return tuple(found)


@dataclass(frozen=True)
class ShellAnalysis:
    commands: tuple[SimpleCommand, ...]
    hazards: tuple[str, ...]
    parse_error: bool


_Event = SimpleCommand | str | None  # str: a hazard; None: a parse error


def analyse(command: str) -> ShellAnalysis:
    """The simple commands, hazards and parse health of one bash command line."""
    events = list(_events(command, 0))
    commands = tuple(e for e in events if isinstance(e, SimpleCommand))
    hazards = tuple(dict.fromkeys(e for e in events if isinstance(e, str)))
    return ShellAnalysis(commands, hazards, None in events)


def rm_root_targets(cmd: SimpleCommand) -> bool:
    """`rm -rf /`, `rm -r -f /*`, `/bin/rm -R /`, `rm --no-preserve-root …`, innermost."""
    layer = cmd.layers[-1] if cmd.layers else cmd.words
    args = layer[1:] if layer and posixpath.basename(layer[0]) == "rm" else ()
    end = args.index("--") if "--" in args else len(args)
    options = [a for a in args[:end] if a.startswith("-") and a != "-"]
    short = "".join(o for o in options if o[1] != "-")
    long = [o.partition("=")[0] for o in options if o[1] == "-" and len(o) > 2]  # any prefix
    recursive = "r" in short or "R" in short or any("--recursive".startswith(o) for o in long)
    targets = [posixpath.normpath("/" + a.lstrip("/")) for a in args if a[:1] == "/"]
    roots = recursive and any(t in ("/", "/*", "/.*") for t in targets)
    return roots or any("--no-preserve-root".startswith(o) for o in long)


_TYPE_HAZARDS = frozenset(  # reported by type name: "simple expansion: $HOME"
    {"simple_expansion", "expansion", "command_substitution", "process_substitution"}
    | {"subscript", "arithmetic_expansion", "brace_expression", "variable_assignment"}
    | {"function_definition", "c_style_for_statement", "for_statement"}
)
_SKIPPED = frozenset({"file_redirect", "heredoc_redirect", "herestring_redirect", "comment"})
_STATEMENTS = ("redirected_statement", "pipeline", "list")
# NUL, CR, FF, VT: tree-sitter splits words on them, bash does not; nor surrogates.
_UNPARSABLE = re.compile("[\x00-\x08\x0b-\x1f\ud800-\udfff]")
_TEST_HAZARDS = frozenset({"-v", "-R", "-eq", "-ne", "-lt", "-le", "-gt", "-ge"})


def _events(command: str, depth: int) -> Iterator[_Event]:
    if _UNPARSABLE.search(command):
        yield None
    source = command.encode("utf-8", "surrogatepass")
    stack = [Parser(_LANGUAGE).parse(source).root_node]
    while stack:
        node = stack.pop()
        stack.extend(reversed(node.children))
        extra = node.type == "file_redirect" and len(node.children_by_field_name("destination")) > 1
        if node.type == "ERROR" or node.is_missing or (extra and not _redirect_owner(node)):
            yield None
        hazard = _node_hazard(node)
        if hazard:
            yield hazard
        if node.type in ("command", "declaration_command", "unset_command"):
            yield from _from_words(_command_words(node, source), depth)


def _text(node: Node) -> str:
    return (node.text or b"").decode("utf-8", "surrogateescape")


def _node_hazard(node: Node) -> str | None:
    kind = node.type
    if kind in _TYPE_HAZARDS:
        return f"{kind.replace('_', ' ')}: {_text(node):.40}"
    if kind == "file_redirect":
        return _redirect_hazard(node)
    if kind == "test_operator" and _text(node) in _TEST_HAZARDS:  # `-v a[$(id)]`, `[[ -eq`
        return f"test {_text(node)} evaluates a variable name or arithmetic"
    if kind == "compound_statement" and node.children[0].type == "((":
        return "arithmetic command (( ))"
    if kind != "heredoc_redirect":
        return None
    start = next((_text(c) for c in node.children if c.type == "heredoc_start"), "'")
    quoted = any(q in start for q in "'\"\\")
    return None if quoted else f"here-document with an unquoted delimiter expands: <<{start}"


def _redirect_hazard(node: Node) -> str | None:
    op = next((c.type for c in node.children if not c.is_named), "")
    dests = node.children_by_field_name("destination")
    if op in ("<&-", ">&-") or not dests:
        return None
    target = _render_seq(dests[:1])
    dup = op in (">&", "<&") and re.fullmatch(r"[0-9]*-?", target.text, re.ASCII) is not None
    if target.literal and (target.text == "/dev/null" or dup):
        return None
    return f"redirection: {_text(node):.40}"


def _redirect_owner(redirect: Node) -> Node | None:
    # `b` of `echo a >/dev/null b` hangs on the redirect, `>f` of `a | b >f` on the pipeline
    node = redirect.parent
    while node is not None and node.type in _STATEMENTS:
        kids = [k for k in node.named_children if k.type not in _SKIPPED]
        node = kids[-1] if kids else None
    return node if node is not None and node.type == "command" else None


@dataclass(frozen=True)
class _Word:
    text: str = ""
    shadow: str = ""  # `text` with quoted characters blanked: where braces and globs act
    literal: bool = True
    hazards: tuple[str, ...] = ()


def _quoted(text: str) -> _Word:
    return _Word(text, "\0" * len(text))


def _command_words(node: Node, source: bytes) -> list[_Word]:
    """argv: tree-sitter's word nodes, joined where bash joins them (`a\\⏎b`, `$"…"`)."""
    skip = _SKIPPED | ({"variable_assignment"} if node.type == "command" else set())
    holders, up = [node], node.parent
    while up is not None and up.type in _STATEMENTS:
        holders, up = [*holders, up], up.parent
    redirects = [r for h in holders for r in h.children if r.type == "file_redirect"]
    owned = [r for r in redirects if (owner := _redirect_owner(r)) and owner.id == node.id]
    parts = [d for r in owned for d in r.children_by_field_name("destination")[1:]]
    for child in node.children:
        parts += child.children if child.type == "command_name" else [child]
    groups: list[list[Node]] = []
    for part in sorted((p for p in parts if p.type not in skip), key=lambda n: n.start_byte):
        gap = source[groups[-1][-1].end_byte : part.start_byte] if groups else b" "
        if gap.replace(b"\\\n", b""):
            groups.append([part])
        else:
            groups[-1].append(part)
    return [_render_seq(group) for group in groups]


def _render_seq(nodes: Sequence[Node]) -> _Word:
    pairs = zip(nodes, [*nodes[1:], None], strict=True)  # `$"…"`: a locale string, as itself
    parts = [_render(n) for n, f in pairs if n.type != "$" or f is None or f.type != "string"]
    text, shadow = "".join(p.text for p in parts), "".join(p.shadow for p in parts)
    braces = (f"brace expansion: {text:.40}",) if _BRACES.search(shadow) else ()  # `{a,b}`
    literal = all(p.literal for p in parts) and not braces
    return _Word(text, shadow, literal, sum((p.hazards for p in parts), braces))


def _render(node: Node) -> _Word:
    kind, text = node.type, _text(node)
    if kind in ("word", "number", "variable_name"):  # `\\x` is a quoted x; `\\⏎` vanishes
        plain = _ESCAPED.sub(lambda m: "" if m[1] == "\n" else m[1], text)
        return _Word(plain, _ESCAPED.sub(lambda m: "" if m[1] == "\n" else "\0", text))
    if not node.is_named:  # `"`, `$` of `a$`, a declaration keyword
        return _quoted(text.strip('"'))
    if kind == "raw_string":
        return _quoted(text[1:-1])
    if kind == "ansi_c_string":
        raw = _C_ESCAPE.sub(_ansi_c_escape, text[2:-1]).encode("utf-8", "surrogateescape")
        return _quoted(raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape"))
    if kind == "string_content":
        return _quoted(_DQ_ESCAPE.sub(lambda m: "" if m[1] == "\n" else m[1], text))
    if kind in ("string", "translated_string", "concatenation"):
        return _render_seq(node.children)
    hazard = () if kind in _TYPE_HAZARDS else (f"unsupported word syntax {kind}: {text:.40}",)
    return _Word(text, "\0" * len(text), False, hazard)


# Escapes inside one node's text (the tree already says which quoting applies).
_BRACES = re.compile(r"\{.*(,|\.\.).*\}", re.DOTALL)  # errs towards seeing one
_ESCAPED = re.compile(r"\\(.)", re.DOTALL)
_DQ_ESCAPE = re.compile(r'\\([$`"\\\n])')
_HEX = "[0-9a-fA-F]"
_C_ESCAPE = re.compile(rf"\\(x{_HEX}{{1,2}}|u{_HEX}{{1,4}}|U{_HEX}{{1,8}}|[0-7]{{1,3}}|c[!-~]|.)")
_C_SIMPLE = dict(zip("abeEfnrtv\\'\"?", "\a\b\x1b\x1b\f\n\r\t\v\\'\"?", strict=True))


def _ansi_c_escape(match: re.Match[str]) -> str:
    """One `$'…'` escape; raw bytes >= 0x80 come back as surrogateescape characters."""
    esc, kind = match[1], match[1][0]
    if len(esc) == 1 and kind in _C_SIMPLE:
        return _C_SIMPLE[kind]
    if kind == "c" and len(esc) == 2:
        return chr(0x7F if esc[1] == "?" else ord(esc[1].upper()) & 0x1F)
    if kind in "01234567" or (kind == "x" and len(esc) > 1):
        value = int(esc, 8) & 0xFF if kind != "x" else int(esc[1:], 16)
        return chr(value if value < 0x80 else 0xDC00 + value)
    value = int(esc[1:], 16) if kind in "uU" and len(esc) > 1 else -1
    return chr(value) if 0 <= value <= 0x10FFFF and not 0xD800 <= value <= 0xDFFF else match[0]


@dataclass(frozen=True)
class _Step:
    """One layer: where its wrapped command starts in its args (None: none), hazards, code."""

    inner: int | None = None
    hazards: tuple[str, ...] = ()
    scripts: tuple[str, ...] = ()


def _from_words(words: Sequence[_Word], depth: int) -> Iterator[_Event]:
    texts = tuple(w.text for w in words)
    starts, steps = [0], []
    while starts[-1] < len(words):
        head, at = words[starts[-1]], starts[-1] + 1
        if not head.literal or any(g in head.shadow for g in "*?["):
            steps.append(_Step(hazards=(f"command name is not literal: {head.text}",)))
            break
        steps.append(_step(posixpath.basename(head.text), texts[at:]))
        if steps[-1].inner is None:
            break
        starts.append(at + (steps[-1].inner or 0))
    yield SimpleCommand(texts, all(w.literal for w in words), tuple(texts[s:] for s in starts))
    yield from (hazard for word in words for hazard in word.hazards)
    for step in steps:
        yield from step.hazards
        for script in step.scripts:
            too_deep = depth >= MAX_DEPTH
            yield from ["shell code nested too deeply"] if too_deep else _events(script, depth + 1)


def _step(name: str, args: Args) -> _Step:
    handler = _HANDLERS.get(name)
    step = handler(args) if handler is not None else _Step()
    flags = tuple(_FLAG_HAZARDS.get(name, "").split())
    hit = next((a for a in args if flags and a.startswith(flags)), None)
    why = _NAME_HAZARDS.get(name) or (f"{hit} assigns or evaluates a variable name" if hit else "")
    return replace(step, hazards=(*step.hazards, f"{name}: {why}")) if why else step


@dataclass(frozen=True)
class _Opts:
    """How a wrapper reads options (space-separated names), getopt style, up to its command."""

    valued: str = ""  # take a value: `-u root`, `-uroot`, `--user=root`
    stops: str = ""  # after one of these it runs no command (`command -v`)
    operands: int = 0  # operands before the command: timeout's DURATION
    assigns: bool = False  # NAME=VALUE words may precede the command (env, sudo)
    shells: str = ""  # with no command, these start a shell reading stdin (sudo -s)
    joins: bool = False  # runs its words joined as `sh -c` code unless -x (watch)
    code: str = ""  # the value is code split by rules unlike bash's (env -S): a hazard
    login: bool = False  # with no command, starts a shell reading stdin (su)


def _parse_opts(args: Args, spec: _Opts) -> tuple[int | None, dict[str, str]]:
    """Where the wrapped command starts (None: no command), and each option's value."""
    seen: dict[str, str] = {}
    i, valued = 0, spec.valued.split()
    while i < len(args) and args[i].startswith("-") and args[i] != "--":  # `su -`, `env -`
        arg, i = args[i], i + 1
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            names, needs_next = [name], name in valued and not eq
        else:
            cut = next((j for j in range(1, len(arg)) if "-" + arg[j] in valued), len(arg))
            names, value = [f"-{c}" for c in arg[1 : cut + 1]], arg[cut + 1 :]
            needs_next = cut < len(arg) and not value
        if needs_next:
            value, i = (args[i] if i < len(args) else ""), i + 1
        seen.update(dict.fromkeys(names, value))
    i += (i < len(args) and args[i] == "--") + spec.operands
    return (None if set(spec.stops.split()) & seen.keys() or i >= len(args) else i), seen


def _wrapper_step(spec: _Opts, args: Args) -> _Step:
    inner, seen = _parse_opts(args, spec)
    assigns = (lambda a: "=" in a) if spec.assigns else (lambda a: False)  # NAME=VALUE
    code = tuple(seen[name] for name in spec.code.split() if name in seen)
    if code:  # su -c runs code as sh -c does; env -S splits it by rules of its own
        hazards = () if spec.login else (f"{spec.code} splits a string into a command",)
        return _Step(hazards=hazards, scripts=code)
    if inner is None:
        shell = spec.login or set(spec.shells.split()) & seen.keys()
        return _Step(hazards=("a shell reading commands from standard input",) if shell else ())
    if spec.joins and not seen.keys() & {"-x", "--exec"}:
        return _Step(scripts=(" ".join(args[inner:]),))  # watch hands its words to `sh -c`
    if args[inner] in ("-c", "--command"):  # flock FILE -c STR, su - USER -c STR
        return _Step(scripts=args[inner + 1 : inner + 2])
    assigned = [f"environment assignment: {a:.40}" for a in takewhile(assigns, args[inner:])]
    end = inner + len(assigned)
    return _Step(end if end < len(args) else None, tuple(assigned))


def _shell_step(args: Args) -> _Step:
    """`bash -c STR` runs STR; `bash FILE` a script; `bash`, `bash -s` read stdin."""
    i, flags = 0, ""
    while i < len(args) and args[i][:1] in ("-", "+") and args[i] not in ("-", "+", "--"):
        arg, i = args[i], i + 1
        flags += arg[1:] if arg[:1] == "-" and arg[1] != "-" else ""
        i += arg in ("--rcfile", "--init-file") if arg[1] == "-" else sum(c in "oO" for c in arg)
    operands = args[i + (i < len(args) and args[i] in ("-", "--")) :]
    if "c" in flags:
        return _Step(scripts=operands[:1])
    if operands and "s" not in flags:
        return _Step(hazards=(f"a shell runs the script file {operands[0]:.40}",))
    return _Step(hazards=("a shell reading commands from standard input",))


def _find_step(args: Args) -> _Step:
    """Each `-exec CMD … ;` / `-execdir` / `-ok` / `-okdir` (or `… {} +`) is a command."""
    scripts, hazards = [], []
    for lo in (i + 1 for i, a in enumerate(args) if a in ("-exec", "-execdir", "-ok", "-okdir")):
        hi = lo
        while hi < len(args) and args[hi] != ";" and not (args[hi] == "+" and args[hi - 1] == "{}"):
            hi += 1
        head = args[lo] if hi > lo else ""  # the shell globbed it before find ran it
        scripts += [shlex.join(args[lo:hi])] if head else []
        hazards += [f"find -exec runs a glob: {head}"] if set(head) & set("*?[") else []
    return _Step(hazards=tuple(hazards), scripts=tuple(scripts))


_SUDO_VALUED = "-u -g -C -D -h -p -r -t -U -T -R --user --group --close-from --chdir --host"
_SUDO_VALUED += " --prompt --role --type --other-user --command-timeout --chroot"
_XARGS_VALUED = "-a -d -E -I -L -n -P -s --arg-file --delimiter --eof --max-lines --max-args"
_XARGS_VALUED += " --max-procs --max-chars --process-slot-var"
_SUDO_SHELL = "-s -i --shell --login"
_SU_CODE = "-c --command -C --session-command"
_SU = _Opts(_SU_CODE + " -s --shell -g --group -G -w", "", 1, code=_SU_CODE, login=True)
_WRAPPERS = {
    **dict.fromkeys(["builtin", "busybox", "coproc", "nohup", "setsid", "unbuffer"], _Opts()),
    "chroot": _Opts("--userspec --groups", operands=1),
    "chrt": _Opts("-T -P -D --sched-runtime --sched-period --sched-deadline", "-p -m", 1),
    "command": _Opts(stops="-v -V"),
    "doas": _Opts("-u -C", "-C", shells="-s"),
    "env": _Opts("-u -C -S --unset --chdir --split-string", assigns=True, code="-S --split-string"),
    "eval": _Opts(joins=True),
    "exec": _Opts("-a"),
    "flock": _Opts("-w -E --wait --timeout --conflict-exit-code", operands=1),
    "ionice": _Opts("-c -n -p -P -u --class --classdata", "-p -P -u --pid --pgid --uid"),
    "nice": _Opts("-n --adjustment"),
    "runuser": _SU,
    "su": _SU,
    "stdbuf": _Opts("-i -o -e --input --output --error"),
    "sudo": _Opts(_SUDO_VALUED, "-e --edit -l --list -v --validate -K -V", 0, True, _SUDO_SHELL),
    "taskset": _Opts(stops="-p --pid", operands=1),
    "time": _Opts("-f -o --format --output"),
    "timeout": _Opts("-s -k --signal --kill-after", operands=1),
    "watch": _Opts("-n -q --interval --equexit", joins=True),
    "xargs": _Opts(_XARGS_VALUED),
}
_SHELLS = "sh bash dash zsh ksh mksh ash rbash yash fish"
_RUNS_CODE = "eval source . trap alias enable fc bind complete compgen"
_ASSIGNS = "let read mapfile readarray getopts declare typeset local export readonly unset"
_FLAG_HAZARDS = {"printf": "-v", "wait": "-p", "hash": "-p", "test": "-v -R", "[": "-v -R"}
_NAME_HAZARDS = {
    **dict.fromkeys(_RUNS_CODE.split(), "runs code"),
    **dict.fromkeys(_ASSIGNS.split(), "assigns or evaluates variables"),
    "coproc": "assigns variables, runs in the background",
}
_HANDLERS: dict[str, Callable[[Args], _Step]] = {
    **{name: partial(_wrapper_step, spec) for name, spec in _WRAPPERS.items()},
    **dict.fromkeys(_SHELLS.split(), _shell_step),
    "find": _find_step,
}
