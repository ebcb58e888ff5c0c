"""What a sed invocation runs or writes, read from its options and its script.

GNU sed runs shell code with the `e` command and the `e` flag of `s`, and writes files
with `w`/`W`, the `w` flag of `s` and `-i`. Its script is read here command by command
(addresses, `s`/`y` with any delimiter, `a`/`i`/`c` text, labels); anything not
understood counts as code, so a reading this module gets wrong errs towards asking.
`--sandbox` makes sed itself refuse `e`, `r` and `w`. Pure: called by `programs`.
"""

from __future__ import annotations

from cmdop_worker.machine.progopts import NOTHING, Args, Use, info_only

_FLAGS = "nErszub"  # short options that take no value
_LONG_FLAGS = [
    "--quiet",
    "--silent",
    "--regexp-extended",
    "--separate",
    "--null-data",
    "--unbuffered",
    "--posix",
    "--debug",
    "--follow-symlinks",
    "--binary",
    "--sandbox",
    "--help",
    "--version",
]
_LONG_VALUED = {"--expression": "-e", "--file": "-f", "--line-length": "-l"}
_NO_ARG = set("=dDgGhHlnNpPxzF}")
_TO_EOL = set("aicrRwWe")  # the rest of the line is the command's argument
_TO_SEMI = set("btTv:qQ")  # a label or number, ended by `;` or a newline
_STD_FILES = ("/dev/stdout", "/dev/stderr")


def sed_use(args: Args) -> Use:
    if info_only(args):
        return NOTHING
    scripts, use, files = _read_args(args)
    if not scripts and not files:
        return Use(code=("sed: no script found",))
    sandboxed = "--sandbox" in args
    for script in scripts:
        found = _script_use(script)
        use += Use(writes=found.writes) if sandboxed else found
    return use


def _read_args(args: Args) -> tuple[list[str], Use, bool]:
    """The -e scripts (or the first operand), what the options themselves do, and
    whether a script file (-f) is read."""
    scripts: list[str] = []
    operands: list[str] = []
    use, files, i = NOTHING, False, 0
    while i < len(args):
        word, i = args[i], i + 1
        if word == "--":
            operands += args[i:]
            break
        if not word.startswith("-") or word == "-":
            operands.append(word)
            continue
        name, value, i = _option(word, args, i)
        if name in ("-e", "-f") and value is None:
            return scripts, Use(code=(f"sed: option {word} without its value",)), files
        if name == "-e":
            scripts.append(value or "")
        elif name == "-f":
            files = True
            use += Use(code=(f"sed runs the script file {value:.40}",))
        elif name == "-i":
            use += Use(writes=(f"sed {word} edits files in place",))
        elif name is None:
            use += Use(code=(f"sed: option not understood: {word:.40}",))
    if not scripts and not files and operands:
        scripts.append(operands[0])
    return scripts, use, files


def _option(word: str, args: Args, i: int) -> tuple[str | None, str | None, int]:
    """One option word: its short name (None: not understood), its value, next index."""
    after = args[i] if i < len(args) else None
    if word.startswith("--"):
        name, eq, value = word.partition("=")
        if len(name) > 3 and "--in-place".startswith(name):
            return "-i", value, i
        hits = [k for k in _LONG_VALUED if k.startswith(name)]
        if len(name) > 3 and len(hits) == 1:
            return _LONG_VALUED[hits[0]], (value if eq else after), i + (not eq)
        flags = [f for f in _LONG_FLAGS if f.startswith(name)]
        return ("-n" if len(name) > 3 and flags and not eq else None), None, i
    for at, c in enumerate(word[1:], 1):
        if c == "i":
            return "-i", word[at + 1 :], i
        if c in "efl":
            rest = word[at + 1 :]
            return f"-{c}", rest or after, i + (not rest)
        if c not in _FLAGS:
            return None, None, i
    return "-n", None, i


def _script_use(script: str) -> Use:
    use, at = NOTHING, 0
    while at < len(script):
        c = script[at]
        if c in " \t\n;{!" or c == "}":
            at += 1
        elif c == "#":
            at = _line_end(script, at)
        else:
            found, at = _command(script, _address_end(script, at))
            if found is None:
                return use + Use(code=(f"sed: script not understood at {script[at:][:20]!r}",))
            use += found
    return use


def _address_end(script: str, at: int) -> int:
    """Past `[addr[,addr]]` and blanks: numbers, `$`, `first~step`, `+N`, `/re/I`."""
    for _ in range(2):
        while at < len(script) and (script[at].isdigit() or script[at] in "$~+ \t"):
            at += 1
        if at < len(script) and script[at] in "/\\":
            delim = script[at] if script[at] == "/" else script[at + 1 : at + 2]
            at = _delimited(script, at + (1 if script[at] == "/" else 2), delim)
            while at < len(script) and script[at] in "IM":
                at += 1
        if at >= len(script) or script[at] != ",":
            break
        at += 1
    while at < len(script) and script[at] in " \t!":
        at += 1
    return at


def _delimited(script: str, at: int, delim: str) -> int:
    """Past the next unescaped `delim` (len(script) + 1 when there is none)."""
    while at < len(script) and script[at] != delim:
        at += 2 if script[at] == "\\" else 1
    return at + 1 if delim and at < len(script) else len(script) + 1


def _line_end(script: str, at: int) -> int:
    end = script.find("\n", at)
    return len(script) if end < 0 else end


def _command(script: str, at: int) -> tuple[Use | None, int]:
    if at >= len(script):
        return (None, at) if at > len(script) else (NOTHING, at)
    c = script[at]
    if c in _NO_ARG or c == "{":
        return NOTHING, at + 1
    if c in _TO_SEMI:  # ended early rather than late: what follows is read as commands
        at += 1
        while at < len(script) and script[at] in " \t":
            at += 1
        while at < len(script) and script[at] not in ";\n} \t":
            at += 1
        return NOTHING, at
    if c in _TO_EOL:
        return _to_eol_use(c, script, at)
    if c in "sy" and at + 1 < len(script) and script[at + 1] not in "\n\\":
        delim = script[at + 1]
        end = _delimited(script, _delimited(script, at + 2, delim), delim)
        if end > len(script):
            return None, at
        return _s_flags(script, end) if c == "s" else (NOTHING, end)
    return None, at


def _to_eol_use(c: str, script: str, at: int) -> tuple[Use, int]:
    end = _line_end(script, at)
    while c in "aic" and end < len(script) and script[end - 1] == "\\":  # text goes on
        end = _line_end(script, end + 1)
    arg = script[at + 1 : end].strip()
    if c == "e":
        return Use(code=("sed e runs shell code",), scripts=(arg,) if arg else ()), end
    if c in "wW" and arg not in _STD_FILES:
        return Use(writes=(f"sed {c} writes the file {arg:.40}",)), end
    return NOTHING, end


def _s_flags(script: str, at: int) -> tuple[Use, int]:
    use = NOTHING
    while at < len(script) and (script[at] in "gpiImMe" or script[at].isdigit()):
        if script[at] == "e":
            use += Use(code=("sed s///e runs the pattern space as shell code",))
        at += 1
    if at < len(script) and script[at] == "w":
        end = _line_end(script, at)
        if script[at + 1 : end].strip() not in _STD_FILES:
            use += Use(writes=("sed s///w writes a file",))
        return use, end
    return use, at
