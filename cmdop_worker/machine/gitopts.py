"""What a git invocation runs or writes beyond looking, for the table of programs.

Git runs programs that its configuration names: `-c alias.x='!cmd'`, `core.pager`,
`core.sshCommand`, `core.fsmonitor`, `diff.external`, filters, credential helpers and
many more. A `-c` key is taken as harmless only in a few display namespaces; any other
runs code. `-C`, `--git-dir`, `--work-tree` and `--template` point git at a repository
(or hooks) whose config the rules never see. Subcommand options that run a program
(`--upload-pack`, `rebase --exec`, `grep -O`, …) run code, `--output` and `git config`
setters write. Pure: called by `programs`.
"""

from __future__ import annotations

from cmdop_worker.machine.progopts import NOTHING, Args, Use, info_only, option_hit, option_values

# Display and identity settings: none of them names a program to run.
_SAFE_KEY_PREFIXES = (
    "color.",
    "advice.",
    "column.",
    "i18n.",
    "user.",
    "core.quotepath",
    "core.abbrev",
    "log.date",
    "log.decorate",
    "log.abbrevcommit",
    "log.follow",
    "format.pretty",
    "safe.directory",
    "diff.renames",
    "diff.noprefix",
    "status.short",
    "status.branch",
)
_GLOBAL_VALUED = "-C -c --git-dir --work-tree --namespace --config-env --super-prefix --attr-source"
_REPO_OPTIONS = ("-C", "--git-dir", "--work-tree", "--exec-path", "--config-env")
_CODE_LONGS = (
    "--upload-pack --receive-pack --exec --ext-diff --textconv --open-files-in-pager"
    " --extcmd --tool --to-cmd --cc-cmd --sendmail-cmd --smtp-server --config --template"
    " --interactive"
)
_CODE_SHORTS = {"grep": "O", "rebase": "xi", "difftool": "xt", "mergetool": "t"}
_CODE_SHORTS |= {"clone": "uc", "ls-remote": "u", "archive": "", "add": "ip"}
_SCRIPT_OPTS = "--exec --upload-pack --receive-pack --extcmd"
_CODE_SUBCOMMANDS = frozenset(
    [
        "filter-branch",
        "difftool",
        "mergetool",
        "instaweb",
        "web--browse",
        "send-email",
        "daemon",
        "bisect",
        "submodule",
        "help",
        "credential",
        "askpass",
    ]
)
_CONFIG_READS = frozenset(
    [
        "-l",
        "--list",
        "--get",
        "--get-all",
        "--get-regexp",
        "--get-urlmatch",
        "--get-color",
        "--get-colorbool",
        "get",
        "list",
    ]
)
_CONFIG_WRITES = frozenset(
    [
        "--add",
        "--replace-all",
        "--unset",
        "--unset-all",
        "--rename-section",
        "--remove-section",
        "set",
        "unset",
        "rename-section",
        "remove-section",
    ]
)


def git_use(args: Args) -> Use:
    if info_only(args):
        return NOTHING
    use, i = NOTHING, 0
    while i < len(args) and args[i].startswith("-"):
        word, i = args[i], i + 1
        name, eq, value = word.partition("=")
        if name in _GLOBAL_VALUED.split() and not eq:
            value, i = (args[i] if i < len(args) else ""), i + 1
        use += _global_option(name, value, bool(eq) or name in _GLOBAL_VALUED.split())
    if i >= len(args):
        return use
    return use + _subcommand(args[i], args[i + 1 :])


def _global_option(name: str, value: str, valued: bool) -> Use:
    if name == "-c":
        return config_use(value)
    if name in _REPO_OPTIONS and (valued or name != "--exec-path"):
        return Use(code=(f"git {name} runs programs that another repository or path names",))
    return NOTHING


def config_use(setting: str) -> Use:
    """One `-c key=value`: code unless the key is a display setting."""
    key, _, value = setting.partition("=")
    key = key.lower()
    if key.startswith(_SAFE_KEY_PREFIXES):
        return NOTHING
    why = f"git -c {key} may name a program git runs"
    if key.startswith("alias.") and value.startswith("!"):
        return Use(code=(why,), scripts=(value[1:],))
    return Use(code=(why,), scripts=(value,) if value and not key.startswith("alias.") else ())


def _subcommand(sub: str, rest: Args) -> Use:
    use = NOTHING
    if sub in _CODE_SUBCOMMANDS:
        use += Use(code=(f"git {sub} runs programs it is given or configured with",))
    if sub == "config":
        use += _config_command(rest)
    hit = option_hit(rest, _CODE_LONGS, _CODE_SHORTS.get(sub, ""))
    if hit:
        scripts = tuple(v for v in option_values(rest, _SCRIPT_OPTS, "") if v)
        scripts += tuple(option_values(rest, "", "x")) if sub == "rebase" else ()
        use += Use(code=(f"git {sub} {hit:.40} runs a program",), scripts=scripts)
    for setting in option_values(rest, "--config", "c" if sub == "clone" else ""):
        use += config_use(setting)
    written = option_hit(rest, "--output --output-directory", "o" if sub != "log" else "")
    if written and sub in ("log", "show", "diff", "format-patch", "archive", "whatchanged"):
        use += Use(writes=(f"git {sub} {written:.40} writes a file",))
    if sub == "bundle" or (sub == "init" and rest):
        use += Use(writes=(f"git {sub} writes files",))
    return use


def _config_command(rest: Args) -> Use:
    if option_hit(rest, "--edit", "e"):
        return Use(code=("git config --edit runs an editor",))
    if _CONFIG_WRITES & set(rest):
        return Use(writes=("git config sets a value: git may run it later",))
    if _CONFIG_READS & set(rest):
        return NOTHING
    values = [a for a in rest if not a.startswith("-")]
    return NOTHING if len(values) <= 1 else Use(writes=("git config sets a value",))


def git_without_globals(args: Args) -> Args | None:
    """`git --no-pager -P push …` -> `push …`: git's arguments with the global options
    before the subcommand removed, so a deny rule for `git push*` meets them; None
    when there are none."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        name, eq, _ = args[i].partition("=")
        i += 1 + (name in _GLOBAL_VALUED.split() and not eq)
    i += i < len(args) and args[i] == "--"
    return args[i:] if 0 < i < len(args) else None
