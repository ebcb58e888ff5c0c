"""Programs the gate cannot know: compilers and launchers that run a program they are
given, and programs named by a path the sandbox may have written. Decided as the gate
decides (`permissions.decide`); the same attempts run through real workers in
`tests/integration/test_gate_outsider_attacks.py`.
"""

from __future__ import annotations

import pytest

from cmdop_worker.machine.gitenv import GIT_SAFE_CONFIG, GIT_SAFE_ENV
from cmdop_worker.machine.permissions import Policy, SandboxPolicy, decide
from cmdop_worker.machine.progpath import searched_path, unknown_program

WALLS = Policy(mode="bypass", deny=("execute_command(touch*)", "execute_command(rm*)"))
PROGRAM_RULES = (
    "gcc cc c99 cpp g++ clang x86_64-linux-gnu-gcc-12 ctest cpack prove sdiff diff3 logsave"
    " busctl pic dmesg ls cat cp ln chmod zz"
)
ALLOWING = Policy(
    allow=(
        *(f"execute_command({p} *)" for p in PROGRAM_RULES.split()),
        "execute_command(*zz*)",
        "execute_command(*/touch*)",
        "execute_command(*x.sh*)",
    ),
    sandbox=SandboxPolicy(writable=("/srv/project",)),
)


def decided(command: str, policy: Policy) -> tuple[str, str]:
    d = decide("execute_command", {"command": command}, policy)
    return d.verdict, d.reason


# Programs that run a program or code given in their options or files.
TABLE = [
    "gcc -wrapper /bin/sh,-c,'touch M',-- -E -x c /dev/null",
    "cc -wrapper /bin/sh,-c,'touch M',-- -E -x c /dev/null",
    "c99 -wrapper /bin/sh,-c,'touch M',-- -E -x c /dev/null",
    "cpp -wrapper /bin/sh,-c,'touch M',-- -x c /dev/null",
    "g++ -wrapper /bin/sh,-c,'touch M',-- -E -x c /dev/null",
    "x86_64-linux-gnu-gcc-12 -wrapper /bin/sh,-c,'touch M',-- -E -x c /dev/null",
    "gcc -B/srv/evil -c x.c",
    "gcc -specs=/srv/evil.specs -E -",
    "gcc @/srv/options -E -",
    "gcc -fplugin=/srv/p.so -c x.c",
    "clang -fuse-ld=/srv/ld x.c",
    "clang -Xclang -load -Xclang /srv/p.so -c x.c",
    "ctest -S /srv/script.cmake",
    "cpack --config /srv/CPackConfig.cmake",
    "prove /srv/t.pl",
    "sdiff --diff-program=/srv/x a b",
    "diff3 --diff-program=/srv/x a b c",
    "logsave /dev/null touch M",
    "busctl --address=unixexec:path=/bin/sh,argv1=-c,argv2=x tree",
    "pic -U /srv/x.pic",
    "dmesg -H",
]


@pytest.mark.parametrize("command", TABLE)
def test_a_program_that_runs_a_program_it_is_given_is_asked_about(command: str) -> None:
    assert decided(command, WALLS)[0] == "ask"
    assert decided(command, ALLOWING)[0] == "ask"


# Programs run from where the sandbox may write, and PATH changed on the line.
PLANTED = [
    "cp /usr/bin/touch /tmp/zz && /tmp/zz -t 200101010000 M",
    "ln -s /usr/bin/touch /tmp/yy && /tmp/yy -t 200101010000 M",
    "cp /usr/bin/touch /srv/project/zz && /srv/project/zz M",
    "cp /usr/bin/python3.11 /tmp/notpy && /tmp/notpy -c 'import os'",
    "ln -s /bin/bash /tmp/q && /tmp/q -c 'touch M'",
    "chmod 755 /srv/project/x.sh && /srv/project/x.sh",
    "./x.sh",
    "bin/zz M",
    "/dev/shm/zz M",
    "/var/tmp/zz M",
    "/run/user/1000/zz M",
    "/proc/self/fd/3 M",
    "/usr/bin/../../tmp/zz M",
    "/usr/./bin/zz M",
    "env /tmp/zz M",
    "timeout 5 /tmp/zz M",
    "find /etc/hostname -exec /tmp/zz {} \\;",
    "echo M | xargs /tmp/zz",
    "exec /tmp/zz M",
    "PATH=/tmp:$PATH zz M",
    "PATH=/tmp zz M",
    "export PATH=/tmp; zz M",
    "hash -p /tmp/zz ls; ls M",
]


@pytest.mark.parametrize("command", PLANTED)
def test_a_program_the_sandbox_could_have_written_is_never_let_through(command: str) -> None:
    assert decided(command, WALLS)[0] == "ask"
    assert decided(command, ALLOWING)[0] == "ask"


def test_the_reason_names_the_path() -> None:
    verdict, reason = decided("/tmp/zz -t 200101010000 M", WALLS)
    assert verdict == "ask"
    assert "/tmp/zz is a program at a path the sandbox may write" in reason


@pytest.mark.parametrize(
    ("word", "unknown"),
    [
        ("/usr/bin/touch", False),
        ("/bin/ls", False),
        ("/usr/local/bin/tool", False),
        ("/opt/tool/bin/x", False),
        ("ls", False),
        ("/srv/project/zz", True),
        ("/srv/projectX/zz", True),  # not a system tree either
        ("/usr/lib/x", False),
        ("/tmp/zz", True),
        ("./zz", True),
        ("zz/x", True),
        ("/usr/../tmp/zz", True),
        ("/home/u/bin/x", True),
    ],
)
def test_which_paths_name_known_programs(word: str, unknown: bool) -> None:
    assert unknown_program(word, ("/srv/project",)) is unknown


def test_a_system_tree_under_a_writable_grant_is_unknown() -> None:
    assert unknown_program("/usr/local/bin/tool", ("/usr/local",))
    assert unknown_program("/usr/bin/touch", ("/",))


@pytest.mark.parametrize(
    "command",
    ["/usr/bin/touch M", "/bin/rm -f M", "env /usr/bin/touch M"],
)
def test_a_system_program_by_path_still_meets_deny_rules(command: str) -> None:
    assert decided(command, WALLS)[0] == "deny"


@pytest.mark.parametrize(
    "command",
    ["ls -l /tmp", "cat /etc/hostname", "ls /srv", "gcc -E -x c /dev/null", "dmesg -T"],
)
def test_plain_uses_are_still_admitted(command: str) -> None:
    assert decided(command, ALLOWING)[0] == "allow"
    assert decided(command, WALLS)[0] == "allow"


def test_a_compile_writes_its_output() -> None:
    verdict, reason = decided("gcc -c x.c", ALLOWING)
    assert verdict == "ask"
    assert "writes what it compiles" in reason


def test_git_is_told_to_run_none_of_a_repositorys_programs() -> None:
    keys = dict(GIT_SAFE_CONFIG)
    assert keys["core.fsmonitor"] == "false"
    assert keys["gpg.program"] == "false"
    assert keys["log.showSignature"] == "false"
    assert keys["core.hooksPath"] == "/dev/null"
    assert GIT_SAFE_ENV["GIT_CONFIG_COUNT"] == str(len(GIT_SAFE_CONFIG))
    count = int(GIT_SAFE_ENV["GIT_CONFIG_COUNT"])
    pairs = [
        (GIT_SAFE_ENV[f"GIT_CONFIG_KEY_{i}"], GIT_SAFE_ENV[f"GIT_CONFIG_VALUE_{i}"])
        for i in range(count)
    ]
    assert pairs == list(GIT_SAFE_CONFIG)


@pytest.mark.parametrize(
    ("path", "writable", "searched"),
    [
        ("/srv/p/bin:/usr/bin:/bin", ("/srv/p",), "/usr/bin:/bin"),
        ("::.:bin:/usr/bin", (), "/usr/bin"),
        ("/tmp/b:/run/b:/dev/shm:/var/tmp/b:/usr/bin", (), "/usr/bin"),
        ("/usr/local/bin:/usr/bin", ("/usr/local",), "/usr/bin"),
        ("/opt/venv/bin:/usr/bin", (), "/opt/venv/bin:/usr/bin"),
        ("/usr/bin:/bin", ("/",), "/usr/bin:/bin"),
        ("/tmp/x", (), "/usr/bin:/bin"),
    ],
)
def test_path_holds_no_directory_a_sandboxed_call_may_write(
    path: str, writable: tuple[str, ...], searched: str
) -> None:
    assert searched_path(path, writable) == searched


# GTFOBins' launchers and programs taking a program: each already read by the table
# or the wrappers, so deny rules meet what it runs or the line is asked about.
GTFOBINS = [
    "taskset 1 touch M",
    "unbuffer touch M",
    "expect -c 'spawn sh'",
    "socat - exec:sh",
    "socat - system:sh",
    "openssl req -engine /srv/e.so",
    "ionice touch M",
    "chrt 1 touch M",
    "runuser -u x -- touch M",
    "su -c 'touch M'",
    "sg g -c x",
    "capsh -- -c x",
    "ld.so /bin/sh",
    "/lib64/ld-linux-x86-64.so.2 /bin/sh",
    "valgrind /bin/sh",
    "ltrace -b -L /bin/sh",
    "perf stat /bin/sh",
    "systemd-run touch M",
    "tclsh",
    "wish",
    "jjs",
    "jrunscript -e x",
    "nmap --script=x",
    "tcpdump -z /srv/x",
    "rpm --eval x",
    "dpkg -i x.deb",
    "groff -U",
    "man -P sh man",
    "more /etc/hostname",
    "ginsh",
    "gawk -f x",
]


@pytest.mark.parametrize("command", GTFOBINS)
def test_gtfobins_launchers_are_never_let_through_past_deny_rules(command: str) -> None:
    assert decided(command, WALLS)[0] in ("ask", "deny")
