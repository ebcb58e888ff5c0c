"""More rows of the table of programs (`programs`): compilers, test runners, document
tools, programs that take another program as an option's value (`rg --pre`, `fd -x`,
`bat --pager`) and environment launchers (`uv run`, `poetry run`, `conda run`, `uvx`,
`faketime`, `nix-shell`).

A compiler driver runs the programs its options name (`gcc -wrapper sh,-c,…`, `-B DIR`
whose `cc1` and `as` it runs, `-specs=FILE` whose `%(…)` and `|` lines run commands,
`@FILE` whose options are not on the line, `-fplugin=`, clang's `-fuse-ld=PATH`); a test
runner runs the tests it finds (`ctest`, `prove`, `pytest`); a document tool's shell
escape runs commands (`latex --shell-escape`, `pic -U`). Pure: each row reads
`(name, args)` and returns a `Use`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from cmdop_worker.machine.progopts import (
    NOTHING,
    Args,
    Options,
    Use,
    always,
    info_only,
    operands,
)

Handler = Callable[[str, Args], Use]

# A word starting with one of these makes a compiler driver run a program it names.
_COMPILER_CODE = (
    "-wrapper -B -specs --specs @ -fplugin -fpass-plugin -fuse-ld --ld-path --gcc-toolchain"
    " -Xclang -Xlinker -Wl, -Xassembler -Xpreprocessor --config -ccc- -fload-pass-plugin"
)
# With one of these the driver writes nothing but its output stream.
_COMPILER_LOOKS = frozenset({"-E", "-fsyntax-only", "-###", "-M", "-MM", "-dumpversion"})
COMPILERS = "gcc cc c89 c99 cpp g++ c++ clang clang++ clang-cpp gfortran f77 f95 gccgo tcc icc icx"


def compiler_use(name: str, args: Args) -> Use:
    """`gcc -wrapper /bin/sh,-c,CMD`, `-B`, `-specs=`, `@file`, `-fplugin=`…: code; a
    compile that is not only preprocessing or checking writes its output file."""
    if info_only(args):
        return NOTHING
    prefixes = tuple(_COMPILER_CODE.split())
    hit = next((a for a in args if a.startswith(prefixes)), None)
    use = Use(code=(f"{name} {hit:.40} runs a program it names",)) if hit else NOTHING
    looks = any(a in _COMPILER_LOOKS or a.startswith("-print-") for a in args)
    return use if looks else use + Use(writes=(f"{name} writes what it compiles",))


_RUNS_TESTS = (
    "ctest cpack prove gtester pytest py.test tox nox pre-commit rspec phpunit jest mocha"
    " vitest ansible ansible-playbook puppet knife vagrant cabal stack cpan cpanm"
    " easy_install msgfilter xdotool openvpn tmate minicom telnet lftp smbclient mutt"
    " run-mailcap crash gimp octave pdb pry byebug ghc slsh ginsh hping3 tasksh"
    " latex pdflatex lualatex xelatex tex pdftex luatex etex dvips cowsay cowthink"
    " snap zypper opkg"
)
# Environment launchers: they run the command they are given, or a project's scripts.
_LAUNCHES = "uvx pipx nix-shell faketime direnv"
_ENVIRONMENTS = "uv poetry conda mamba micromamba pdm hatch pipenv rye nix"
_RUN_SUBCOMMANDS = frozenset(["run", "exec", "x", "dlx", "shell", "develop", "tool", "script"])


def _runs_subcommand(name: str, args: Args) -> Use:
    """`uv run CMD`, `poetry run CMD`, `conda run CMD`, `nix shell …`: any operand naming
    a subcommand that runs a command is taken as one (global options with values are not
    known, so the subcommand may not be the first operand)."""
    hit = next((a for a in operands(args) if a in _RUN_SUBCOMMANDS), None)
    return Use(code=(f"{name} {hit} runs a command it is given",)) if hit else NOTHING


def triplet_name(name: str) -> str:
    """`x86_64-linux-gnu-gcc` -> `gcc`, `arm-none-eabi-g++` -> `g++`: a cross tool is read
    as the tool its last part names."""
    return name.rsplit("-", 1)[-1] if name.count("-") >= 2 else name


ROWS: Mapping[str, Handler] = {
    **dict.fromkeys(COMPILERS.split(), compiler_use),
    **dict.fromkeys(_RUNS_TESTS.split(), always("runs code its files or input give it")),
    **dict.fromkeys(("sdiff", "diff3"), Options("--diff-program", "--output -o")),
    "pic": Options("-U"),  # unsafe mode: `sh` blocks
    "busctl": Options("--address --xml-interface"),  # `unixexec:path=/bin/sh`
    "dmesg": Options("-H --human -L"),  # -H pages through less
    "pandoc": Options("--filter --lua-filter -F -L", "--output -o"),
    "scrot": Options("--exec -e"),
    "tshark": Options("-X", "-w"),
    "aria2c": Options(
        "--on-download-complete --on-download-error --on-download-start --on-download-stop"
        " --on-bt-download-complete --on-download-pause --conf-path"
    ),
    "certbot": Options(
        "--pre-hook --post-hook --deploy-hook --renew-hook --manual-auth-hook"
        " --manual-cleanup-hook --config -c"
    ),
    "restic": Options("--password-command"),
    "fzf": Options("--preview --bind --listen --with-shell"),
    **dict.fromkeys(("rpmdb", "rpmquery", "rpmverify", "rpmspec"), Options("--eval -E")),
    # A program named by an option's value: `rg --pre CMD`, `fd -x CMD`, `bat --pager CMD`.
    "rg": Options("--pre", scripts=False),
    **dict.fromkeys(("fd", "fdfind"), Options("--exec --exec-batch -x -X", scripts=False)),
    **dict.fromkeys(("bat", "batcat"), Options("--pager", scripts=False)),
    **dict.fromkeys(_LAUNCHES.split(), always("runs a command it is given")),
    **dict.fromkeys(_ENVIRONMENTS.split(), _runs_subcommand),
}
