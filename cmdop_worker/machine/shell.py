"""What a bash command line runs, read with tree-sitter-bash, for the permission gate.

`analyse` finds every simple command in a line (code strings of `bash -c`, `eval`, `su -c`
parsed again), its argv as each wrapper (`sudo`, `env`, `nice -n 5`) is stripped, and the
hazards: whatever can run code or name a file a rule's text does not show. Called by
`machine.permissions`, with `rm_root_targets` for its floor. How each wrapper reads its
options, and which programs run code, is `wrappers`.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain

import tree_sitter_bash
from tree_sitter import Language, Node, Parser

from cmdop_worker.machine.linear import Linear
from cmdop_worker.machine.programs import command_use
from cmdop_worker.machine.wrappers import Step, takes_code, wrapper_step

MAX_DEPTH = 5  # how deep `bash -c "eval 'sh -c …'"` strings are parsed again
MAX_LAYERS = 16  # wrappers stripped from one command (`nice nice … nice id`)
_LANGUAGE = Language(tree_sitter_bash.language())


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
        """What rule globs are tried on: each layer as `rule_text`, and again with its
        argv[0] as a basename (`/usr/sbin/reboot` -> `reboot`)."""
        found: dict[str, None] = {}
        for argv in filter(None, self.layers):
            base = (posixpath.basename(argv[0]), *argv[1:])
            found[rule_text(argv)] = found[rule_text(base)] = None
        return tuple(found)


_PLAIN_WORD = re.compile(r"[\w@%+=:,./*?\[\]~^!{}-]+")


def rule_text(words: Sequence[str]) -> str:
    """Words as a rule glob sees them: plain, with shell quoting only on a word that
    holds spaces or shell syntax, so `git 'status; id'` is not `git status; id`, while a
    glob argument stays as written (`cat /var/log/*.log`)."""
    return " ".join(word if _PLAIN_WORD.fullmatch(word) else shlex.quote(word) for word in words)


@dataclass(frozen=True)
class ShellAnalysis:
    """`hazards`: shell syntax that can run code or name a file a rule's text does not
    show. `runs_code`: code a program runs that rules cannot read (`programs`: awk's
    program text, `sed e`, a pager). `writes`: options by which a program writes files
    or acts beyond looking (`sort -o`, `find -delete`)."""

    commands: tuple[SimpleCommand, ...]
    hazards: tuple[str, ...]
    parse_error: bool
    runs_code: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Found:
    """A program's finding: hidden code it runs, or a write."""

    why: str
    writes: bool = False


_Event = SimpleCommand | str | _Found | None  # str: a hazard; None: a parse error


def analyse(command: str) -> ShellAnalysis:
    """The simple commands, hazards and parse health of one bash command line."""
    events = list(_events(command, 0))
    commands = tuple(e for e in events if isinstance(e, SimpleCommand))
    hazards = tuple(dict.fromkeys(e for e in events if isinstance(e, str)))
    found = [e for e in events if isinstance(e, _Found)]
    code = tuple(dict.fromkeys(f.why for f in found if not f.writes))
    writes = tuple(dict.fromkeys(f.why for f in found if f.writes))
    return ShellAnalysis(commands, hazards, None in events, code, writes)


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


@dataclass
class _Tree:
    """One parsed line, its nodes in order with their parents. tree-sitter finds a
    node's parent by walking down from the root, so parents are kept here as the tree
    is walked: reading a line stays linear in its length."""

    nodes: list[Node] = field(default_factory=list)
    parents: dict[int, Node] = field(default_factory=dict)
    owners: dict[int, Node | None] = field(default_factory=dict)
    owned: dict[int, list[Node]] = field(default_factory=dict)

    @classmethod
    def parse(cls, source: bytes) -> _Tree:
        tree, stack = cls(), [Parser(_LANGUAGE).parse(source).root_node]
        while stack:
            node = stack.pop()
            tree.nodes.append(node)
            kids = node.children
            tree.parents.update((kid.id, node) for kid in kids)
            stack.extend(reversed(kids))
        for node in tree.nodes:
            owner = tree.redirect_owner(node) if node.type == "file_redirect" else None
            if owner is not None:
                tree.owned.setdefault(owner.id, []).append(node)
        return tree

    def redirect_owner(self, redirect: Node) -> Node | None:
        """The command a redirect belongs to: `b` of `echo a >/dev/null b` hangs on the
        redirect, `>f` of `a | b >f` on the pipeline. Each statement is resolved once."""
        path, node = [], self.parents.get(redirect.id)
        while node is not None and node.type in _STATEMENTS and node.id not in self.owners:
            path.append(node)
            kids = [k for k in node.named_children if k.type not in _SKIPPED]
            node = kids[-1] if kids else None
        if node is not None and node.id in self.owners:
            node = self.owners[node.id]
        owner = node if node is not None and node.type == "command" else None
        self.owners.update((step.id, owner) for step in path)
        return owner


def _events(command: str, depth: int) -> Iterator[_Event]:
    if _UNPARSABLE.search(command):
        yield None
    source = command.encode("utf-8", "surrogatepass")
    tree = _Tree.parse(source)
    for node in tree.nodes:
        extra = node.type == "file_redirect" and len(node.children_by_field_name("destination")) > 1
        if node.type == "ERROR" or node.is_missing or (extra and not tree.redirect_owner(node)):
            yield None
        hazard = _node_hazard(node)
        if hazard:
            yield hazard
        if node.type in ("command", "declaration_command", "unset_command"):
            words, split = _command_words(node, source, tree.owned.get(node.id, []))
            if split:  # bash ends a command at a newline that tree-sitter folded into it
                yield None
            yield from _from_words(words, depth)


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


@dataclass(frozen=True)
class _Word:
    text: str = ""
    shadow: str = ""  # `text` with quoted characters blanked: where braces and globs act
    literal: bool = True
    hazards: tuple[str, ...] = ()


def _quoted(text: str) -> _Word:
    return _Word(text, "\0" * len(text))


def _command_words(node: Node, source: bytes, owned: Sequence[Node]) -> tuple[list[_Word], bool]:
    """argv: tree-sitter's word nodes, joined where bash joins them (`a\\⏎b`, `$"…"`),
    words hanging on the redirects it `owned` included; and whether a bare newline lies
    between two of them (`ls⏎\\⏎id` is two commands to bash, one to tree-sitter)."""
    skip = _SKIPPED | ({"variable_assignment"} if node.type == "command" else set())
    parts = [d for r in owned for d in r.children_by_field_name("destination")[1:]]
    for child in node.children:
        parts += child.children if child.type == "command_name" else [child]
    groups: list[list[Node]] = []
    split = False
    for part in sorted((p for p in parts if p.type not in skip), key=lambda n: n.start_byte):
        gap = source[groups[-1][-1].end_byte : part.start_byte] if groups else b" "
        gap = gap.replace(b"\\\n", b"")
        split = split or b"\n" in gap
        if gap:
            groups.append([part])
        else:
            groups[-1].append(part)
    return [_render_seq(group) for group in groups], split


def _render_seq(nodes: Sequence[Node]) -> _Word:
    pairs = zip(nodes, [*nodes[1:], None], strict=True)  # `$"…"`: a locale string, as itself
    parts = [_render(n) for n, f in pairs if n.type != "$" or f is None or f.type != "string"]
    text, shadow = "".join(p.text for p in parts), "".join(p.shadow for p in parts)
    braces = (f"brace expansion: {text:.40}",) if _BRACES.search(shadow) else ()  # `{a,b}`
    literal = all(p.literal for p in parts) and not braces
    return _Word(text, shadow, literal, (*braces, *chain.from_iterable(p.hazards for p in parts)))


def _render_string(node: Node) -> _Word:
    """`"…"`: its parts, and the text tree-sitter leaves between them (a newline)."""
    raw, base = node.text or b"", node.start_byte
    parts, at = [], base + 1
    for child in node.children[1:-1]:
        gap = raw[at - base : child.start_byte - base].decode("utf-8", "surrogateescape")
        parts += [_quoted(_DQ_ESCAPE.sub(lambda m: "" if m[1] == "\n" else m[1], gap))]
        parts.append(_render(child))
        at = child.end_byte
    tail = raw[at - base : len(raw) - 1].decode("utf-8", "surrogateescape")
    parts.append(_quoted(_DQ_ESCAPE.sub(lambda m: "" if m[1] == "\n" else m[1], tail)))
    return _Word(
        "".join(p.text for p in parts),
        "".join(p.shadow for p in parts),
        all(p.literal for p in parts),
        tuple(chain.from_iterable(p.hazards for p in parts)),
    )


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
    if kind == "string":
        return _render_string(node)
    if kind in ("translated_string", "concatenation"):
        return _render_seq(node.children)
    hazard = () if kind in _TYPE_HAZARDS else (f"unsupported word syntax {kind}: {text:.40}",)
    return _Word(text, "\0" * len(text), False, hazard)


# Escapes inside one node's text (the tree already says which quoting applies).
_BRACES = Linear(r"(?s)\{.*(?:,|\.\.).*\}")  # errs towards seeing one
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


def _from_words(words: Sequence[_Word], depth: int) -> Iterator[_Event]:
    texts = tuple(w.text for w in words)
    starts, steps = [0], []
    while starts[-1] < len(words):
        if len(starts) > MAX_LAYERS:
            steps.append(Step(hazards=("wrappers nested too deeply",)))
            break
        head, at = words[starts[-1]], starts[-1] + 1
        if not head.literal or any(g in head.shadow for g in "*?["):
            steps.append(Step(hazards=(f"command name is not literal: {head.text}",)))
            break
        steps.append(wrapper_step(posixpath.basename(head.text), texts[at:]))
        if steps[-1].inner is None:
            break
        starts.append(at + (steps[-1].inner or 0))
    layers = tuple(texts[s:] for s in starts)
    yield SimpleCommand(texts, all(w.literal for w in words), layers)
    yield from (hazard for word in words for hazard in word.hazards)
    own = [texts[s + 1 : end] for s, end in zip(starts, [*starts[1:], len(texts)], strict=True)]
    use = command_use(layers, own, takes_code)
    yield from (_Found(why) for why in use.code)
    yield from (_Found(why, writes=True) for why in use.writes)
    yield from chain.from_iterable(step.hazards for step in steps)
    for script in chain(chain.from_iterable(step.scripts for step in steps), use.scripts):
        too_deep = depth >= MAX_DEPTH
        yield from ["shell code nested too deeply"] if too_deep else _events(script, depth + 1)
