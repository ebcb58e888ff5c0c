"""How wrappers run the command they are given, for the shell analysis (`shell`).

`wrapper_step(name, args)` says of one argv layer whether a wrapped command follows
and where (`sudo -u root env nice -n 5 reboot` -> `env nice …` -> `nice …` ->
`reboot`), which code strings it runs (`bash -c STR`, `su -c STR`, `find -exec`,
`watch`, `eval`), and what makes it a hazard. An option a wrapper is not known to take
is a hazard too: GNU tools accept abbreviations (`env --ch DIR`, `timeout --sig KILL`)
and options with values, so past an unknown one the wrapped command cannot be told
for sure, and deny rules must not be trusted to see it. Pure; imports nothing of ours.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from itertools import takewhile

Args = tuple[str, ...]


@dataclass(frozen=True)
class Step:
    """One layer: where its wrapped command starts in its args (None: none), hazards, code."""

    inner: int | None = None
    hazards: tuple[str, ...] = ()
    scripts: tuple[str, ...] = ()


def wrapper_step(name: str, args: Args) -> Step:
    handler = _HANDLERS.get(name)
    step = handler(args) if handler is not None else Step()
    flags = tuple(_FLAG_HAZARDS.get(name, "").split())
    hit = next((a for a in args if flags and a.startswith(flags)), None)
    what = _FLAG_REASONS.get(name, "assigns or evaluates a variable name")
    why = _NAME_HAZARDS.get(name) or (f"{hit} {what}" if hit else "")
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
    flags: str = ""  # options that take no value; any option not named here is unknown

    @property
    def known(self) -> frozenset[str]:
        names = " ".join((self.valued, self.stops, self.shells, self.code, self.flags))
        return frozenset(names.split())


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


def _wrapper_step(spec: _Opts, args: Args) -> Step:
    """The layer, plus a hazard for each option the wrapper is not known to take: an
    abbreviation or an option with a value hides where the wrapped command starts."""
    step = _known_wrapper_step(spec, args)
    _, seen = _parse_opts(args, spec)
    unknown = [name for name in seen if name not in spec.known]
    if not unknown:
        return step
    return replace(step, hazards=(*step.hazards, f"unknown wrapper option: {' '.join(unknown)}"))


def _known_wrapper_step(spec: _Opts, args: Args) -> Step:
    inner, seen = _parse_opts(args, spec)
    assigns = (lambda a: "=" in a) if spec.assigns else (lambda a: False)  # NAME=VALUE
    code = tuple(seen[name] for name in spec.code.split() if name in seen)
    if code:  # su -c runs code as sh -c does; env -S splits it by rules of its own
        hazards = () if spec.login else (f"{spec.code} splits a string into a command",)
        return Step(hazards=hazards, scripts=code)
    if inner is None:
        shell = spec.login or set(spec.shells.split()) & seen.keys()
        return Step(hazards=("a shell reading commands from standard input",) if shell else ())
    if spec.joins and not seen.keys() & {"-x", "--exec"}:
        return Step(scripts=(" ".join(args[inner:]),))  # watch hands its words to `sh -c`
    if args[inner] in ("-c", "--command"):  # flock FILE -c STR, su - USER -c STR
        return Step(scripts=args[inner + 1 : inner + 2])
    assigned = [f"environment assignment: {a:.40}" for a in takewhile(assigns, args[inner:])]
    end = inner + len(assigned)
    return Step(end if end < len(args) else None, tuple(assigned))


def _shell_step(args: Args) -> Step:
    """`bash -c STR` runs STR; `bash FILE` a script; `bash`, `bash -s` read stdin."""
    i, flags = 0, ""
    while i < len(args) and args[i][:1] in ("-", "+") and args[i] not in ("-", "+", "--"):
        arg, i = args[i], i + 1
        flags += arg[1:] if arg[:1] == "-" and arg[1] != "-" else ""
        i += arg in ("--rcfile", "--init-file") if arg[1] == "-" else sum(c in "oO" for c in arg)
    operands = args[i + (i < len(args) and args[i] in ("-", "--")) :]
    if "c" in flags:
        return Step(scripts=operands[:1])
    if operands and "s" not in flags:
        return Step(hazards=(f"a shell runs the script file {operands[0]:.40}",))
    return Step(hazards=("a shell reading commands from standard input",))


def _find_step(args: Args) -> Step:
    """Each `-exec CMD … ;` / `-execdir` / `-ok` / `-okdir` (or `… {} +`) is a command."""
    scripts, hazards = [], []
    for lo in (i + 1 for i, a in enumerate(args) if a in ("-exec", "-execdir", "-ok", "-okdir")):
        hi = lo
        while hi < len(args) and args[hi] != ";" and not (args[hi] == "+" and args[hi - 1] == "{}"):
            hi += 1
        head = args[lo] if hi > lo else ""  # the shell globbed it before find ran it
        scripts += [shlex.join(args[lo:hi])] if head else []
        hazards += [f"find -exec runs a glob: {head}"] if set(head) & set("*?[") else []
        hazards += [f"find -exec runs the files it finds: {head}"] if "{}" in head else []
    return Step(hazards=tuple(hazards), scripts=tuple(scripts))


_SUDO_VALUED = "-u -g -C -D -h -p -r -t -U -T -R --user --group --close-from --chdir --host"
_SUDO_VALUED += " --prompt --role --type --other-user --command-timeout --chroot"
_XARGS_VALUED = "-a -d -E -I -L -n -P -s --arg-file --delimiter --eof --max-lines --max-args"
_XARGS_VALUED += " --max-procs --max-chars --process-slot-var"
_SUDO_SHELL = "-s -i --shell --login"
_SU_CODE = "-c --command -C --session-command"
_SU_FLAGS = "- -l --login -m -p --preserve-environment -f --fast -P --pty"
_SU = _Opts(
    _SU_CODE + " -s --shell -g --group -G -w", "", 1, code=_SU_CODE, login=True, flags=_SU_FLAGS
)
_SUDO_FLAGS = "-A --askpass -b --background -B --bell -E --preserve-env -H --set-home -k"
_SUDO_FLAGS += " --reset-timestamp -n --non-interactive -P --preserve-groups -S --stdin"
_SUDO_FLAGS += " --version --remove-timestamp"
_XARGS_FLAGS = "-0 --null -o --open-tty -p --interactive -r --no-run-if-empty -t --verbose"
_XARGS_FLAGS += " -x --exit"
_WRAPPERS = {
    **dict.fromkeys(["builtin", "busybox", "coproc", "nohup", "unbuffer"], _Opts()),
    "setsid": _Opts(flags="-c --ctty -f --fork -w --wait"),
    "chroot": _Opts("--userspec --groups", operands=1, flags="--skip-chdir"),
    "chrt": _Opts(
        "-T -P -D --sched-runtime --sched-period --sched-deadline",
        "-p -m",
        1,
        flags="-a -b -d -f -i -o -r -R -v --all-tasks --batch --deadline --fifo --idle"
        " --other --rr --reset-on-fork --verbose",
    ),
    "command": _Opts(stops="-v -V", flags="-p"),
    "doas": _Opts("-u -C", "-C", shells="-s", flags="-n -L"),
    "env": _Opts(
        "-u -C -S --unset --chdir --split-string",
        assigns=True,
        code="-S --split-string",
        flags="- -i --ignore-environment -0 --null -v --debug",
    ),
    "eval": _Opts(joins=True),
    "exec": _Opts("-a", flags="-c -l"),
    "flock": _Opts(
        "-w -E --wait --timeout --conflict-exit-code",
        operands=1,
        flags="-s --shared -x -e --exclusive -u --unlock -n --nb --nonblock -o --close"
        " -F --no-fork --verbose",
    ),
    "ionice": _Opts(
        "-c -n -p -P -u --class --classdata", "-p -P -u --pid --pgid --uid", flags="-t --ignore"
    ),
    "nice": _Opts("-n --adjustment"),
    "runuser": _SU,
    "su": _SU,
    "stdbuf": _Opts("-i -o -e --input --output --error"),
    "sudo": _Opts(
        _SUDO_VALUED,
        "-e --edit -l --list -v --validate -K -V",
        0,
        True,
        _SUDO_SHELL,
        flags=_SUDO_FLAGS,
    ),
    "taskset": _Opts(stops="-p --pid", operands=1, flags="-a --all-tasks -c --cpu-list"),
    "time": _Opts("-f -o --format --output", flags="-p --portability -v --verbose -a --append -q"),
    "timeout": _Opts(
        "-s -k --signal --kill-after",
        operands=1,
        flags="--preserve-status --foreground -v --verbose",
    ),
    "watch": _Opts(
        "-n -q --interval --equexit",
        joins=True,
        flags="-b --beep -c --color -d --differences -e --errexit -g --chgexit -t --no-title"
        " -x --exec -w --no-wrap -p --precise",
    ),
    "xargs": _Opts(_XARGS_VALUED, flags=_XARGS_FLAGS),
}
_SHELLS = "sh bash dash zsh ksh mksh ash rbash yash fish"
# Run a command they are given, in ways not parsed here: opaque to deny rules.
_LAUNCHERS = "systemd-run pkexec script sg setpriv unshare nsenter strace ltrace parallel runcon"
_LAUNCHERS += " capsh ssh-agent dbus-run-session dbus-launch xvfb-run fakeroot firejail bwrap"
_LAUNCHERS += " proot catchsegv torsocks proxychains proxychains4 tsocks numactl cgexec"
_LAUNCHERS += " systemd-inhibit systemd-cat systemd-nspawn prlimit chpst daemonize entr trickle"
_LAUNCHERS += " newgrp logsave cpulimit setlock softlimit sshpass torify multitime grc openvt"
_LAUNCHERS += " distcc service run-one envdir setuidgid pexec"
_RUNS_CODE = "eval source . trap alias enable fc bind complete compgen"
_ASSIGNS = "let read mapfile readarray getopts declare typeset local export readonly unset"
_ASSIGNING = "assigns or evaluates variables"
_FLAG_HAZARDS = {"printf": "-v", "wait": "-p", "hash": "-p", "test": "-v -R", "[": "-v -R"}
_FLAG_HAZARDS["exec"] = "-a"
_FLAG_REASONS = {"exec": "sets the program's argv[0], a name deny rules never see"}
_NAME_HAZARDS = {
    **dict.fromkeys(_RUNS_CODE.split(), "runs code"),
    **dict.fromkeys(_ASSIGNS.split(), _ASSIGNING),
    "coproc": "assigns variables, runs in the background",
    **dict.fromkeys(_LAUNCHERS.split(), "runs another program the rules cannot see"),
}
_HANDLERS: dict[str, Callable[[Args], Step]] = {
    **{name: partial(_wrapper_step, spec) for name, spec in _WRAPPERS.items()},
    **dict.fromkeys(_SHELLS.split(), _shell_step),
    "find": _find_step,
}


def takes_code(name: str) -> bool:
    """Whether `name` runs a command or code given in its arguments: a wrapper, a shell,
    a launcher, `eval` and its kin."""
    return name in _HANDLERS or (name in _NAME_HAZARDS and _NAME_HAZARDS[name] != _ASSIGNING)
