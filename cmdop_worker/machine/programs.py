"""The table of programs that run code or write files through their options or scripts.

Taken from GTFOBins' categories (shell, command, file-write): for each program, what
makes one invocation run code that a rule cannot read (`Use.code`: awk's program text,
`sed e`, `tar --checkpoint-action=exec=`, `sort --compress-program`, `git -c
alias.x=!…`, a pager or an editor, any interpreter's script), shell code it runs that
can be read and is parsed again (`Use.scripts`), and what makes it write files or act
beyond looking (`Use.writes`: `sort -o`, `find -fprint`, `sed -i`, `curl -o`, …).

The gate (`permissions`) never admits either by an allow rule's glob; deny and ask
rules cannot see hidden code, so a line holding any is asked about even where the mode
would allow it. Programs whose whole job is writing (cp, mv, tee's operands are the
exception, install, ln, rm, …) are left to the rule that names them and to the
sandbox, which keeps a command let through by a rule read-only outside the policy's
`writable` paths. Pure: called by `shell` for every layer of every simple command.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from cmdop_worker.machine.gitopts import git_use
from cmdop_worker.machine.progopts import (
    NOTHING,
    Args,
    Use,
    info_only,
    operands,
    option_hit,
    option_values,
    single_dash_hit,
)
from cmdop_worker.machine.sedscript import sed_use

__all__ = ["PROGRAMS", "Use", "command_use", "program_use"]

Handler = Callable[[str, Args], Use]


def _always(what: str) -> Handler:
    """Any invocation but `--version`/`--help` runs code the rules cannot read."""
    return lambda name, args: NOTHING if info_only(args) else Use(code=(f"{name} {what}",))


@dataclass(frozen=True)
class _Options:
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
            longs, shorts = _names(self.code)
            values = option_values(args, longs, "")
            values += [v for letter in shorts for v in option_values(args, "", letter)]
            use += Use(scripts=tuple(v for v in values if v))
        return use + (Use(writes=(f"{name} {written:.40} writes a file",)) if written else NOTHING)

    def _hit(self, args: Args, names: str) -> str | None:
        if not names:
            return None
        if self.single:
            return single_dash_hit(args, names)
        longs, shorts = _names(names)
        return option_hit(args, longs, shorts)


def _names(names: str) -> tuple[str, str]:
    words = names.split()
    return " ".join(w for w in words if w.startswith("--")), "".join(
        w[1] for w in words if len(w) == 2 and w[0] == "-"
    )


def _tar(name: str, args: Args) -> Use:
    cluster = args[0] if args and not args[0].startswith("-") else ""  # `tar xvf a.tar`
    actions = option_values(args, "--checkpoint-action", "")
    scripts = tuple(a.split("=", 1)[1] for a in actions if a.startswith("exec="))
    use = _Options(_TAR_CODE)(name, args)
    if scripts:
        use += Use(code=("tar --checkpoint-action=exec runs shell code",), scripts=scripts)
    if set(cluster) & set("IF"):
        use += Use(code=(f"tar {cluster} names a program",))
    archives = operands(args) + option_values(args, "--file", "f")
    if "--force-local" not in args and any(":" in a.split("/", 1)[0] for a in archives):
        use += Use(code=("tar reaches a remote archive through a remote shell",))
    modes = option_hit(args, _TAR_WRITES, "cxruA")
    modes = modes or (cluster if set(cluster) & set("cxruA") else None)
    return use + (Use(writes=(f"tar {modes} writes files",)) if modes else NOTHING)


_TAR_CODE = (
    "--to-command --use-compress-program --info-script --new-volume-script --rsh-command"
    " --rmt-command -I -F"
)
_TAR_WRITES = "--create --extract --get --append --update --catenate --concatenate --delete"
_SSH_CODE_KEYS = frozenset(
    {"proxycommand", "localcommand", "knownhostscommand", "match", "include"}
    | {"permitlocalcommand"}
)


def _ssh_family(name: str, args: Args) -> Use:
    """ssh/scp/sftp: `-o ProxyCommand=…` and friends run local commands; `-F` reads a
    config that may; scp/sftp `-S` (and sftp `-D`, `-b`) run a program."""
    use = NOTHING
    for setting in option_values(args, "", "o"):
        key, _, value = setting.replace("=", " ", 1).partition(" ")
        if key.lower() in _SSH_CODE_KEYS:
            script = (value.strip(),) if key.lower().endswith("command") else ()
            use += Use(code=(f"{name} -o {key} runs a local command",), scripts=script)
    shorts = {"sftp": "FSDb", "scp": "FS"}.get(name, "F")
    hit = option_hit(args, "", shorts)
    use += Use(code=(f"{name} {hit} runs or configures a local program",)) if hit else NOTHING
    logged = option_hit(args, "", "E") if name == "ssh" else None
    return use + (Use(writes=(f"{name} -E writes a log file",)) if logged else NOTHING)


def _zip(name: str, args: Args) -> Use:
    commands = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-TT"]
    commands += [a[3:] for a in args if a.startswith("-TT") and len(a) > 3]
    commands += option_values(args, "--unzip-command", "")
    if not commands:
        return NOTHING
    return Use(code=("zip -TT runs a command to test the archive",), scripts=tuple(commands))


def _subcommands(safe: str, what: str) -> Handler:
    """Package managers: any subcommand but the read-only ones runs packages' code."""
    safe_set = frozenset(safe.split())

    def use(name: str, args: Args) -> Use:
        if info_only(args):
            return NOTHING
        if name.startswith("apt") and option_hit(args, "--option --config-file", "oc"):
            return Use(code=(f"{name} -o/-c sets configuration that can run commands",))
        found = operands(args)
        if found and found[0] in safe_set:
            return NOTHING
        return Use(code=(f"{name} {found[0] if found else '(no subcommand)'} {what}",))

    return use


def _operand_writes(name: str, args: Args) -> Use:
    """tee writes every file operand, dd its `of=`."""
    named = [a[3:] for a in args if a.startswith("of=")] if name == "dd" else operands(args)
    targets = [t for t in named if t not in ("/dev/null", "/dev/stdout", "/dev/stderr")]
    return Use(writes=(f"{name} writes {targets[0]:.40}",)) if targets else NOTHING


_WGET_WRITES = (
    "--output-file --append-output --directory-prefix --save-cookies --warc-file"
    " --recursive --mirror -o -a -P -r -m -x"
)


def _wget(name: str, args: Args) -> Use:
    use = _Options("--use-askpass --execute --config -e", _WGET_WRITES)(name, args)
    documents = option_values(args, "--output-document", "O")
    to_stdout = documents and all(d in ("-", "/dev/null") for d in documents)
    if not to_stdout and "--spider" not in args:
        use += Use(writes=("wget saves what it downloads",))
    return use


def _crontab(name: str, args: Args) -> Use:
    if "-l" in args and not operands(args, "-u"):
        return NOTHING
    return Use(code=("crontab installs commands that cron runs",))


def _split(name: str, args: Args) -> Use:
    return _Options("--filter")(name, args) + Use(writes=(f"{name} writes its pieces",))


def _ip(name: str, args: Args) -> Use:
    if "exec" not in args:  # `ip netns exec NS CMD`, `ip vrf exec VRF CMD`
        return NOTHING
    command = shlex.join(args[args.index("exec") + 2 :])
    return Use(code=("ip … exec runs a command",), scripts=(command,) if command else ())


def _run_parts(name: str, args: Args) -> Use:
    if {"--test", "--list"} & set(args):
        return NOTHING
    return Use(code=("run-parts runs every script in a directory",))


_INTERPRETERS = (
    "awk gawk mawk nawk perl python pypy ruby irb erb node nodejs deno bun php lua luajit"
    " tclsh wish expect jjs jrunscript Rscript julia guile ghci runghc pwsh gjs osascript dc m4"
)
_PAGERS_EDITORS = (
    "less more most pg man vim vi nvim view vimdiff rvim ex ed red emacs nano pico joe mg"
    " jed sudoedit visudo vipw vigr edquota"
)
_OPAQUE = (
    "make gmake bmake gdb lldb at batch tmux screen socat mail mailx ftp sqlite3 mysql"
    " mariadb psql valgrind perf start-stop-daemon ld.so ld-linux.so.2 ld-linux-x86-64.so.2"
    " rlwrap setarch linux32 linux64 patch logrotate npx bunx"
)
_NETCAT = _Options("--exec --sh-exec --lua-exec -e -c")
_CURL_WRITES = (
    "--output --remote-name --remote-name-all --dump-header --cookie-jar --trace"
    " --trace-ascii --stderr --libcurl --output-dir --etag-save --hsts --alt-svc -o -O -D -c"
)
_DPKG_CODE = (
    "--install --unpack --configure --remove --purge --triggers-only --extract --vextract"
    " --build --set-selections --recursive -i -r -P -x -X -b -R"
)
_JOURNALCTL_ACTS = (
    "--host --machine --rotate --vacuum-size --vacuum-time --vacuum-files --flush --sync"
    " --relinquish-var --smart-relinquish-var --setup-keys --update-catalog -H -M"
)
_APT_READS = "list show search policy depends rdepends madison showpkg showsrc help moo"
_PIP_READS = "list show freeze check help search index inspect debug hash completion"
_NPM_READS = "ls list ll la view v info show outdated search help root prefix bin ping whoami"
_MAINTAINER_SCRIPTS = "runs packages' maintainer scripts"
_TABLE: dict[str, Handler] = {
    **dict.fromkeys(_INTERPRETERS.split(), _always("runs its program text")),
    **dict.fromkeys(_PAGERS_EDITORS.split(), _always("is a pager or editor: it runs commands")),
    **dict.fromkeys(_OPAQUE.split(), _always("runs commands its input or files give it")),
    **dict.fromkeys(("nc", "ncat", "netcat"), _NETCAT),
    **dict.fromkeys(("groff", "troff", "nroff"), _Options("-U")),  # unsafe mode: `.sy`
    **dict.fromkeys(("ssh", "scp", "sftp"), _ssh_family),
    **dict.fromkeys(("dd", "tee"), _operand_writes),
    "git": lambda name, args: git_use(args),
    "sed": lambda name, args: sed_use(args),
    "tar": _tar,
    "find": _Options("-exec -execdir -ok -okdir", "-fprint -fprint0 -fprintf -fls -delete", True),
    "sort": _Options("--compress-program", "--output -o"),
    "rsync": _Options(
        "--rsh --rsync-path --remote-option -e -M", "--log-file --write-batch --only-write-batch"
    ),
    "zip": _zip,
    "split": _split,
    "tcpdump": _Options("-z", "-w"),
    "nmap": _Options("--script --interactive -sC -A", "-oN -oX -oG -oA -oS", True),
    "openssl": _Options(
        "-engine -provider -provider-path -config engine",
        "-out -keyout -certout -writerand -sess_out",
        True,
    ),
    "curl": _Options("--config --engine -K", _CURL_WRITES, scripts=False),
    "wget": _wget,
    "time": _Options(writes="--output --append -o -a"),
    "ssh-keygen": _Options("-D"),  # loads a PKCS#11 library
    "ip": _ip,
    "hg": _Options("--config --debugger"),
    "crontab": _crontab,
    "run-parts": _run_parts,
    "dpkg": _Options(_DPKG_CODE, scripts=False),
    "apt": _subcommands(_APT_READS, _MAINTAINER_SCRIPTS),
    "apt-get": _subcommands("check help moo", _MAINTAINER_SCRIPTS),
    "aptitude": _subcommands("search show why why-not help", _MAINTAINER_SCRIPTS),
    "pip": _subcommands(_PIP_READS, "runs packages' build code"),
    "npm": _subcommands(_NPM_READS + " explain why", "runs packages' scripts"),
    "yarn": _subcommands("list info why outdated help", "runs packages' scripts"),
    "pnpm": _subcommands("list ls why outdated help", "runs packages' scripts"),
    # Options by which a look-around program acts elsewhere or changes state:
    # `systemctl status -H host` runs ssh with the worker's keys, `journalctl --rotate`
    # makes journald act.
    "systemctl": _Options(writes="--host --machine -H -M"),
    "journalctl": _Options(writes=_JOURNALCTL_ACTS),
}
PROGRAMS: Mapping[str, Handler] = MappingProxyType(_TABLE)


def program_use(name: str, args: Args) -> Use:
    """What `name ARGS` does beyond its own work; `python3.11` is read as `python`."""
    handler = PROGRAMS.get(name) or PROGRAMS.get(name.rstrip("0123456789.-"))
    if handler is None and name.startswith("pip"):
        handler = PROGRAMS["pip"]
    return handler(name, args) if handler is not None else NOTHING


def command_use(
    layers: Sequence[Args], own: Sequence[Args], takes_code: Callable[[str], bool]
) -> Use:
    """One simple command: each layer's program read on its own arguments (`own`), and
    xargs' rule: the words it appends from its input reach the innermost program, so a
    program that runs code from its arguments (a shell, a wrapper left without its
    command, anything in the table) or a name holding `-I`'s placeholder is hidden code."""
    use = NOTHING
    for argv, args in zip(layers, own, strict=True):
        use += program_use(_base(argv[0]), args) if argv else NOTHING
    at = next((i for i, argv in enumerate(layers) if argv and _base(argv[0]) == "xargs"), None)
    if at is None or at + 1 >= len(layers) or not layers[-1]:
        return use
    inner = _base(layers[-1][0])
    given = option_values(own[at], "--replace", "I") + option_values(own[at], "", "i")
    placeholders = [p or "{}" for p in given]
    if takes_code(inner) or inner in PROGRAMS or any(p in layers[-1][0] for p in placeholders):
        use += Use(code=(f"xargs hands its input to {inner:.40}, which may run it",))
    return use


def _base(word: str) -> str:
    return word.rsplit("/", 1)[-1]
