"""The table of programs that run code or write files through their options or scripts.

Taken from GTFOBins' categories (shell, command, file-write): for each program, what
makes one invocation run code that a rule cannot read (`Use.code`: awk's program text,
`sed e`, `tar --checkpoint-action=exec=`, `sort --compress-program`, `git -c
alias.x=!…`, a pager or an editor, any interpreter's script), shell code it runs that
can be read and is parsed again (`Use.scripts`), and what makes it write files or act
beyond looking (`Use.writes`: `sort -o`, `find -fprint`, `sed -i`, `curl -o`, …).

The gate (`permissions`) never admits either by an allow rule's glob; deny and ask
rules cannot see hidden code, so a line holding any is asked about even where the mode
would allow it. Programs whose whole job is writing (cp, mv, install, ln, rm, …) are
left to the rule that names them and to the sandbox, which keeps a command let through
by a rule read-only outside the policy's `writable` paths; tee's and dd's files count
as writes, as both also serve look-around pipelines. The rows needing more than a list
of option names are in `progtools`, `gitopts` and `sedscript`. Pure: called by `shell`
for every layer of every simple command.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from cmdop_worker.machine import progtools
from cmdop_worker.machine.gitopts import git_use
from cmdop_worker.machine.progopts import (
    NOTHING,
    Args,
    Options,
    Use,
    always,
    info_only,
    operands,
    option_hit,
    option_values,
)
from cmdop_worker.machine.sedscript import sed_use
from cmdop_worker.machine.toolchains import ROWS, triplet_name

__all__ = ["PROGRAMS", "Use", "command_use", "program_use"]

Handler = Callable[[str, Args], Use]


def _subcommands(safe: str, what: str, valued: str = "") -> Handler:
    """Package managers and the like: any subcommand but the read-only ones runs code.
    `valued`: options whose value is a separate word before the subcommand."""
    safe_set = frozenset(safe.split())

    def use(name: str, args: Args) -> Use:
        if info_only(args):
            return NOTHING
        if name.startswith("apt") and option_hit(args, "--option --config-file", "oc"):
            return Use(code=(f"{name} -o/-c sets configuration that can run commands",))
        found = operands(args, valued)
        if found and found[0] in safe_set:
            return NOTHING
        return Use(code=(f"{name} {found[0] if found else '(no subcommand)'} {what}",))

    return use


_INTERPRETERS = (
    "awk gawk mawk nawk original-awk goawk perl python pypy ruby irb erb node nodejs deno"
    " bun php lua luajit tclsh wish expect jjs jrunscript jshell groovy scala R Rscript julia"
    " guile racket sbcl ocaml swipl ghci runghc pwsh gjs osascript dc m4 java dotnet ts-node"
    " tsx php-cgi mongo mongosh"
    " csh tcsh rc es elvish nu xonsh posh"  # shells the parser does not read
)
_PAGERS_EDITORS = (
    "less more most pg man vim vi nvim gvim view rview vimdiff rvim evim ex ed red emacs"
    " emacsclient nano pico micro mcedit joe mg jed sudoedit visudo vipw vigr edquota pager"
    " editor sensible-pager sensible-editor sensible-browser www-browser xdg-open pydoc"
    " perldoc ri"
)
_OPAQUE = (
    "make gmake bmake cmake ninja meson scons ant mvn gradle rake bundle cargo composer"
    " gdb lldb at batch tmux screen socat mail mailx ftp sqlite3 mysql mariadb psql"
    " valgrind perf start-stop-daemon ld.so ld-linux.so.2 ld-linux-x86-64.so.2 rlwrap"
    " setarch linux32 linux64 patch logrotate npx bunx dpkg-reconfigure"
)
_NETCAT = Options("--exec --sh-exec --lua-exec -e -c")
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
_DNF_READS = "list info search repolist provides check-update history help deplist repoquery"
_DOCKER_READS = "ps images inspect logs version info stats top port diff history events"
_DOCKER_VALUED = "-H --host -c --context --config -l --log-level"
_KUBECTL_READS = "get describe logs top version explain api-resources api-versions cluster-info"
_KUBECTL_VALUED = "-n --namespace --context --cluster --kubeconfig -s --server --user"
_TABLE: dict[str, Handler] = {
    **dict.fromkeys(_INTERPRETERS.split(), always("runs its program text")),
    **dict.fromkeys(_PAGERS_EDITORS.split(), always("is a pager or editor: it runs commands")),
    **dict.fromkeys(_OPAQUE.split(), always("runs commands its input or files give it")),
    **dict.fromkeys(("nc", "ncat", "netcat"), _NETCAT),
    **dict.fromkeys(("groff", "troff", "nroff"), Options("-U")),  # unsafe mode: `.sy`
    **dict.fromkeys(("ssh", "scp", "sftp"), progtools.ssh_family_use),
    **dict.fromkeys(("dd", "tee"), progtools.operand_writes_use),
    "git": lambda name, args: git_use(args),
    "sed": lambda name, args: sed_use(args),
    "tar": progtools.tar_use,
    "find": Options("-exec -execdir -ok -okdir", "-fprint -fprint0 -fprintf -fls -delete", True),
    "sort": Options("--compress-program", "--output -o"),
    "rsync": Options(
        "--rsh --rsync-path --remote-option -e -M", "--log-file --write-batch --only-write-batch"
    ),
    "zip": progtools.zip_use,
    "split": progtools.split_use,
    "tcpdump": Options("-z", "-w"),
    "nmap": Options("--script --interactive -sC -A", "-oN -oX -oG -oA -oS", True),
    "openssl": Options(
        "-engine -provider -provider-path -config engine",
        "-out -keyout -certout -writerand -sess_out",
        True,
    ),
    "curl": Options("--config --engine -K", _CURL_WRITES, scripts=False),
    "wget": progtools.wget_use,
    "time": Options(writes="--output --append -o -a"),
    "ssh-keygen": Options("-D"),  # loads a PKCS#11 library
    "ip": progtools.ip_use,
    "hg": Options("--config --debugger"),
    "crontab": progtools.crontab_use,
    "run-parts": progtools.run_parts_use,
    "dpkg": Options(_DPKG_CODE, scripts=False),
    "apt": _subcommands(_APT_READS, _MAINTAINER_SCRIPTS),
    "apt-get": _subcommands("check help moo", _MAINTAINER_SCRIPTS),
    "aptitude": _subcommands("search show why why-not help", _MAINTAINER_SCRIPTS),
    "pip": _subcommands(_PIP_READS, "runs packages' build code"),
    "npm": _subcommands(_NPM_READS + " explain why", "runs packages' scripts"),
    "yarn": _subcommands("list info why outdated help", "runs packages' scripts"),
    "pnpm": _subcommands("list ls why outdated help", "runs packages' scripts"),
    "gem": _subcommands("list search info query help environment contents", "runs gems' code"),
    "go": _subcommands("version env list doc fmt vet help", "builds and runs code"),
    "dnf": _subcommands(_DNF_READS, _MAINTAINER_SCRIPTS),
    "yum": _subcommands(_DNF_READS, _MAINTAINER_SCRIPTS),
    "sudo": Options("--edit -e", scripts=False),  # sudoedit: an editor
    "cpio": Options("--rsh-command --rmt-command", "--extract --pass-through -i -p"),
    "rpm": Options("--install --upgrade --freshen --erase --eval --reinstall -i -U -F -e"),
    "docker": _subcommands(_DOCKER_READS, "runs containers and commands in them", _DOCKER_VALUED),
    "podman": _subcommands(_DOCKER_READS, "runs containers and commands in them", _DOCKER_VALUED),
    "kubectl": _subcommands(
        _KUBECTL_READS, "acts on the cluster or runs commands in it", _KUBECTL_VALUED
    ),
    # Options by which a look-around program acts elsewhere or changes state:
    # `systemctl status -H host` runs ssh with the worker's keys, `journalctl --rotate`
    # makes journald act.
    "systemctl": Options(writes="--host --machine -H -M"),
    "journalctl": Options(writes=_JOURNALCTL_ACTS),
    **ROWS,
}
PROGRAMS: Mapping[str, Handler] = MappingProxyType(_TABLE)


def program_use(name: str, args: Args) -> Use:
    """What `name ARGS` does beyond its own work; `python3.11` is read as `python`."""
    plain = name.rstrip(_VERSION_CHARS)  # `x86_64-linux-gnu-gcc-12` is a gcc
    handler = PROGRAMS.get(name) or PROGRAMS.get(plain) or PROGRAMS.get(triplet_name(plain))
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
        name = _base(argv[0]) if argv else ""
        use += program_use(name, args) if argv else NOTHING
        plain = name.rstrip(_VERSION_CHARS)
        if plain != name and takes_code(plain) and not takes_code(name):  # `ksh93 -c …`
            use += Use(code=(f"{name} reads as {plain}, which runs code it is given",))
    at = next((i for i, argv in enumerate(layers) if argv and _base(argv[0]) == "xargs"), None)
    if at is None or at + 1 >= len(layers) or not layers[-1]:
        return use
    inner = _base(layers[-1][0])
    given = option_values(own[at], "--replace", "I") + option_values(own[at], "", "i")
    placeholders = [p or "{}" for p in given]
    if takes_code(inner) or inner in PROGRAMS or any(p in layers[-1][0] for p in placeholders):
        use += Use(code=(f"xargs hands its input to {inner:.40}, which may run it",))
    return use


_VERSION_CHARS = "0123456789.-"


def _base(word: str) -> str:
    return word.rsplit("/", 1)[-1]
