"""How a program's own options are read for the table of programs (`programs`).

`Use` is what one invocation does beyond its own work: code it runs that rules cannot
read, shell code it runs that can be read, files it writes or places it acts on.
`Options` reads a table row of option names; `option_hit` and `option_values` read
options as getopt does, erring towards seeing
one: a long option also as an abbreviation (`--compress-p`) or with `=value`, a short
one anywhere in a cluster (`-rno x`). Pure; imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

Args = tuple[str, ...]

# Asking a program only for its version or help runs none of its code paths.
INFO_ONLY = frozenset({"--version", "-V", "--help", "-h", "-v", "-version", "-help"})


@dataclass(frozen=True)
class Use:
    """What one program invocation does beyond its own work."""

    code: tuple[str, ...] = ()  # why it runs code the rules cannot read
    scripts: tuple[str, ...] = ()  # shell code it runs that can be read (parsed again)
    writes: tuple[str, ...] = ()  # why it writes files or acts beyond looking

    def __add__(self, other: Use) -> Use:
        return Use(self.code + other.code, self.scripts + other.scripts, self.writes + other.writes)


NOTHING = Use()


def info_only(args: Args) -> bool:
    return bool(args) and all(a in INFO_ONLY for a in args)


def _options(args: Args) -> Iterator[tuple[int, str]]:
    """(index, word) of every word that reads as an option, up to `--`."""
    for i, word in enumerate(args):
        if word == "--":
            return
        if word.startswith("-") and len(word) > 1:
            yield i, word


def _long_hit(word: str, longs: Iterable[str]) -> str | None:
    name = word.split("=", 1)[0]  # getopt takes any unique prefix: `--o=F` is `--output=F`
    return next((o for o in longs if o.startswith(name)), None)


def option_hit(args: Args, longs: str = "", shorts: str = "") -> str | None:
    """The first word that is one of the options: long names (space-separated, taken
    also abbreviated) or short letters (taken anywhere in a cluster)."""
    long_names = longs.split()
    for _, word in _options(args):
        if word.startswith("--"):
            if _long_hit(word, long_names):
                return word
        elif any(c in shorts for c in word[1:]):
            return word
    return None


def option_values(args: Args, longs: str = "", short: str = "") -> list[str]:
    """The values given to a valued option: `--opt=V`, `--opt V`, `-oV`, `-xo V`."""
    found, long_names = [], longs.split()
    for i, word in _options(args):
        after = args[i + 1] if i + 1 < len(args) else ""
        if word.startswith("--"):
            if _long_hit(word, long_names):
                found.append(word.split("=", 1)[1] if "=" in word else after)
        elif short and short in word[1:]:
            rest = word[word.index(short, 1) + 1 :]
            found.append(rest or after)
    return found


def single_dash_hit(args: Args, names: str) -> str | None:
    """The first word that is one of `names` spelled whole (find's `-exec`, openssl's
    `-out`); also as `-name=value`."""
    wanted = frozenset(names.split())
    return next((a for a in args if a.split("=", 1)[0] in wanted), None)


def operands(args: Args, valued: str = "") -> list[str]:
    """The words that are not options nor option values (`valued`: short letters and
    long names that take a separate value)."""
    found: list[str] = []
    skip, takes = False, frozenset(valued.split())
    for i, word in enumerate(args):
        if skip:
            skip = False
        elif word == "--":
            return found + list(args[i + 1 :])
        elif word.startswith("-") and len(word) > 1:
            skip = word in takes or (not word.startswith("--") and f"-{word[-1]}" in takes)
        else:
            found.append(word)
    return found


def always(what: str) -> Callable[[str, Args], Use]:
    """Any invocation but `--version`/`--help` runs code the rules cannot read."""
    return lambda name, args: NOTHING if info_only(args) else Use(code=(f"{name} {what}",))


@dataclass(frozen=True)
class Options:
    """Options (space-separated; `-x` a short letter, `--name` a long one, or with
    `single` whole words such as find's `-exec`) that run code or write files."""

    code: str = ""
    writes: str = ""
    single: bool = False
    scripts: bool = True  # the code options' values are shell code, parsed again

    def __call__(self, name: str, args: Args) -> Use:
        code, written = self._hit(args, self.code), self._hit(args, self.writes)
        use = Use(code=(f"{name} {code:.40} runs a program",)) if code else NOTHING
        if code and self.scripts and not self.single:
            longs, shorts = option_names(self.code)
            values = option_values(args, longs, "")
            values += [v for letter in shorts for v in option_values(args, "", letter)]
            use += Use(scripts=tuple(v for v in values if v))
        return use + (Use(writes=(f"{name} {written:.40} writes a file",)) if written else NOTHING)

    def _hit(self, args: Args, names: str) -> str | None:
        if not names:
            return None
        if self.single:
            return single_dash_hit(args, names)
        longs, shorts = option_names(names)
        return option_hit(args, longs, shorts)


def option_names(names: str) -> tuple[str, str]:
    words = names.split()
    return " ".join(w for w in words if w.startswith("--")), "".join(
        w[1] for w in words if len(w) == 2 and w[0] == "-"
    )
