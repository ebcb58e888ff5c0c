"""Handlers of the table of programs (`programs`) for programs whose options need more
than a list of names: tar's old-style clusters and `--checkpoint-action=exec=`, ssh's
`-o` settings, zip's `-TT`, wget's default of saving, crontab, split, ip, run-parts,
dd and tee. Each reads `(name, args)` and returns a `Use`. Pure.
"""

from __future__ import annotations

import shlex

from cmdop_worker.machine.progopts import (
    NOTHING,
    Args,
    Options,
    Use,
    operands,
    option_hit,
    option_values,
)


def tar_use(name: str, args: Args) -> Use:
    cluster = args[0] if args and not args[0].startswith("-") else ""  # `tar xvf a.tar`
    actions = option_values(args, "--checkpoint-action", "")
    scripts = tuple(a.split("=", 1)[1] for a in actions if a.startswith("exec="))
    use = Options(_TAR_CODE)(name, args)
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


def ssh_family_use(name: str, args: Args) -> Use:
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


def zip_use(name: str, args: Args) -> Use:
    commands = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-TT"]
    commands += [a[3:] for a in args if a.startswith("-TT") and len(a) > 3]
    commands += option_values(args, "--unzip-command", "")
    if not commands:
        return NOTHING
    return Use(code=("zip -TT runs a command to test the archive",), scripts=tuple(commands))


def operand_writes_use(name: str, args: Args) -> Use:
    """tee writes every file operand, dd its `of=`."""
    named = [a[3:] for a in args if a.startswith("of=")] if name == "dd" else operands(args)
    targets = [t for t in named if t not in ("/dev/null", "/dev/stdout", "/dev/stderr")]
    return Use(writes=(f"{name} writes {targets[0]:.40}",)) if targets else NOTHING


_WGET_WRITES = (
    "--output-file --append-output --directory-prefix --save-cookies --warc-file"
    " --recursive --mirror -o -a -P -r -m -x"
)


def wget_use(name: str, args: Args) -> Use:
    use = Options("--use-askpass --execute --config -e", _WGET_WRITES)(name, args)
    documents = option_values(args, "--output-document", "O")
    to_stdout = documents and all(d in ("-", "/dev/null") for d in documents)
    if not to_stdout and "--spider" not in args:
        use += Use(writes=("wget saves what it downloads",))
    return use


def crontab_use(name: str, args: Args) -> Use:
    if "-l" in args and not operands(args, "-u"):
        return NOTHING
    return Use(code=("crontab installs commands that cron runs",))


def split_use(name: str, args: Args) -> Use:
    return Options("--filter")(name, args) + Use(writes=(f"{name} writes its pieces",))


def ip_use(name: str, args: Args) -> Use:
    if "exec" not in args:  # `ip netns exec NS CMD`, `ip vrf exec VRF CMD`
        return NOTHING
    command = shlex.join(args[args.index("exec") + 2 :])
    return Use(code=("ip … exec runs a command",), scripts=(command,) if command else ())


def run_parts_use(name: str, args: Args) -> Use:
    if {"--test", "--list"} & set(args):
        return NOTHING
    return Use(code=("run-parts runs every script in a directory",))
