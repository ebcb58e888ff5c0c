"""Programs that run code or write files for you, attacked through real machine workers.

Each attempt tries to create a marker file by way of a program's options or script:
awk's `system()`, `sed e`, `git -c alias.x=!…`, `tar --checkpoint-action=exec=`,
`sort --compress-program=sh`, `xargs sh -c`, `find -fprint`, … (GTFOBins' shell,
command and file-write entries). Three machines, the marker directory writable in
every one's sandbox, so only the gate stands between an attempt and its marker:

- `open`: mode bypass, no rules. Every attempt must create its marker here: this is
  what proves each one really runs code (or writes) and that the other two can fail.
- `walls`: mode bypass, a deny rule on `touch`: every code-running attempt is denied,
  or asked about and, with nobody to answer, denied.
- `allowing`: mode default, allow rules for each program (`sed *`, `awk *`, `git *`,
  …), asks answered by nobody: no code-running or file-writing option gets through,
  while the same programs' plain reading forms still run.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ...conftest import PolicyBase, run_tool_calls

pytestmark = pytest.mark.integration


# {m}: the marker. Each runs code that touches it; none names `touch` where a rule on
# `touch` could see it without reading the program's own options or script.
CODE_ATTEMPTS = [
    # As reported.
    "echo 'touch {m}' | xargs -I{} sh -c {}",
    "git -c alias.x='!touch {m}' x",
    "awk 'BEGIN{system(\"touch {m}\")}'",
    "sed -n '1e touch {m}' /etc/hostname",
    "tar cf /dev/null /etc/hostname --checkpoint=1 --checkpoint-action=exec='touch {m}'",
    "seq 50000 | sed 's|.*|touch {m}|' | sort -S 64K --compress-program=sh",
    # xargs hands its input to a program that runs it.
    "echo touch {m} | xargs env",
    "echo touch {m} | xargs timeout 5",
    "echo touch {m} | xargs nice",
    "printf 'touch {m}' | xargs -0 sh -c",
    "xargs -I% env % {m} <<< touch",
    "echo {m} | xargs -I% sh -c 'touch %'",
    # awk, sed
    "awk 'BEGIN{\"touch {m}\" | getline}'",
    "mawk 'BEGIN{system(\"touch {m}\")}'",
    "awk -f /dev/stdin <<< 'BEGIN{system(\"touch {m}\")}'",
    "sed '1e touch {m}' /etc/hostname",
    "sed -n 's|.*|touch {m}|ep' /etc/hostname",
    "nice -n 1 sed -n '1e touch {m}' /etc/hostname",
    # git
    "git -c core.sshCommand='touch {m}' ls-remote ssh://x/y",
    "git ls-remote --upload-pack='touch {m}' /etc",
    "git -c core.fsmonitor='touch {m}' status",
    # tar, zip, split, find
    "tar cf - /etc/hostname | tar xf - --to-command='touch {m}'",
    "tar cf /dev/null -I 'sh -c \"touch {m}\"' /etc/hostname",
    "zip /tmp/z.zip /etc/hostname -T -TT 'touch {m} #'",
    "split --filter='touch {m}' /etc/hostname",
    "find /etc/hostname -exec sh -c 'touch {m}' \\;",
    "find /etc/hostname -execdir sh -c 'touch {m}' \\;",
    # interpreters, editors, debuggers, launchers
    "perl -e 'system(\"touch {m}\")'",
    "env -i perl -e 'system \"touch {m}\"'",
    "python3 -c 'import os; os.system(\"touch {m}\")'",
    "stdbuf -o0 python3 -c 'import os; os.system(\"touch {m}\")'",
    "timeout 5 awk 'BEGIN{system(\"touch {m}\")}'",
    'node -e \'require("child_process").execSync("touch {m}")\'',
    "vim -es -c '!touch {m}' -c 'q!'",
    "printf '!touch {m}\\nq\\n' | ed",
    "gdb -nx -batch -ex 'shell touch {m}'",
    "make -f /dev/null --eval='x:=$(shell touch {m})'",
    "sqlite3 :memory: '.shell touch {m}'",
    "echo 'exec touch {m}' | tclsh",
    "ssh -o ProxyCommand='touch {m}' x",
    "script -qc 'touch {m}' /dev/null",
    "strace -f -o /dev/null touch {m}",
    "env -S 'touch {m}'",
    # A rule for a wrapper (`env *`, `timeout *`, `xargs *`) admits no command it runs.
    "env touch {m}",
    "timeout 5 touch {m}",
    "nice -n 1 touch {m}",
    "echo {m} | xargs touch",
]
# Options that write a file; only the allow rules meet them (a deny rule on `touch`
# is no rule about writing).
WRITE_ATTEMPTS = [
    "find /etc/hostname -fprint {m}",
    "find /etc/hostname -fprint0 {m}",
    "find /etc/hostname -fprintf {m} %p",
    "find /etc/hostname -fls {m}",
    "sort -o {m} /etc/hostname",
    "sort /etc/hostname --output={m}",
    "sed -n 'w {m}' /etc/hostname",
    "sed -n 's/^/x/w {m}' /etc/hostname",
    "dd if=/etc/hostname of={m}",
    "tar cf {m} /etc/hostname",
    "curl -s file:///etc/hostname -o {m}",
    "git log -1 --output={m}",
]
PROGRAMS = (
    "sed awk mawk find tar sort xargs git env zip make less perl python3 node vim ed gdb"
    " sqlite3 tclsh ssh split dd curl timeout nice stdbuf script strace echo printf seq cat"
)
ALLOWING = (
    'mode = "default"\n[rules]\nallow = ['
    + ", ".join(f'"execute_command({p} *)"' for p in PROGRAMS.split())
    + "]\n"
)


@dataclass
class Fleet:
    client: Client
    fake: FakeAnthropic
    markers: Path  # writable in every machine's sandbox

    def run(self, machine: str, commands: list[str]) -> list[Event]:
        uses = [{"name": "execute_command", "input": {"command": c}} for c in commands]
        return run_tool_calls(self.client, self.fake, machine, uses)


@pytest.fixture(scope="module")
def fleet(
    attack_base: PolicyBase,
    fake_model: FakeAnthropic,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("programs")
    markers = Path(f"/var/tmp/cmdop-programs-{uuid.uuid4().hex[:8]}")
    markers.mkdir(parents=True)
    writable = f'[sandbox]\nwritable = ["{markers}"]\n'
    policies = {
        "open": 'mode = "bypass"\n' + writable,
        "walls": 'mode = "bypass"\n[rules]\ndeny = ["execute_command(touch*)"]\n' + writable,
        "allowing": ALLOWING + writable,
    }
    try:
        with attack_base.machines(work, policies) as client:
            yield Fleet(client, fake_model, markers)
    finally:
        shutil.rmtree(markers, ignore_errors=True)


def marked(commands: list[str], directory: Path) -> list[tuple[str, Path]]:
    directory.mkdir()
    return [
        (c.replace("{m}", str(directory / f"m{i}")), directory / f"m{i}")
        for i, c in enumerate(commands)
    ]


def attack(
    fleet: Fleet, machine: str, templates: list[str]
) -> tuple[list[str], list[tuple[str, str]]]:
    """Run every attempt on `machine`: those whose marker appeared, and those whose call
    was not refused (as templates, `{m}` unfilled)."""
    attempts = marked(templates, fleet.markers / f"{machine}-{uuid.uuid4().hex[:6]}")
    ends = fleet.run(machine, [command for command, _ in attempts])
    created = [
        t for t, (_, marker) in zip(templates, attempts, strict=True) if os.path.lexists(marker)
    ]
    passed = [
        (t, end.data["status"])
        for t, end in zip(templates, ends, strict=True)
        if end.data["status"] != "denied"
    ]
    return created, passed


def test_the_corpus_is_large_enough() -> None:
    assert len(CODE_ATTEMPTS) + len(WRITE_ATTEMPTS) >= 31


def test_every_attempt_really_runs_code_or_writes_when_nothing_stops_it(fleet: Fleet) -> None:
    commands = CODE_ATTEMPTS + WRITE_ATTEMPTS
    created, _ = attack(fleet, "open", commands)
    assert [c for c in commands if c not in created] == []


def test_a_deny_rule_meets_code_that_a_program_runs(fleet: Fleet) -> None:
    created, passed = attack(fleet, "walls", CODE_ATTEMPTS)
    assert created == []
    assert passed == []


def test_an_allow_rule_for_a_program_admits_none_of_its_code_or_writes(fleet: Fleet) -> None:
    created, passed = attack(fleet, "allowing", CODE_ATTEMPTS + WRITE_ATTEMPTS)
    assert created == []
    assert passed == []


def test_the_same_programs_still_read_under_their_allow_rules(fleet: Fleet) -> None:
    archive = fleet.markers / "a.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add("/etc/hostname", arcname="hostname")
    reads = [
        "sed -n 1p /etc/hostname",
        "find /etc/hostname -name hostname",
        f"tar tf {archive}",
        "git status --short",
        "sort /etc/hostname",
        "cat /etc/hostname | xargs echo",
        "echo a b | xargs -n1 echo",
        "sed -e 's/a/b/g' -e 1q /etc/hostname",
        "git log -1 --format=%H",
        "git -c color.ui=never log -1 --oneline",
        "dd if=/etc/hostname count=1 status=none",
    ]
    ends = fleet.run("allowing", reads)
    assert [(c, e.data["status"]) for c, e in zip(reads, ends, strict=True)] == [
        (c, "ok") for c in reads
    ]


def test_a_command_too_long_to_read_is_refused_as_invalid(fleet: Fleet) -> None:
    (end,) = fleet.run("open", ["true " + "x" * (64 * 1024)])
    assert end.data["status"] == "invalid", end.data
    assert "the most a machine reads is 65536" in end.data["output"]


def test_a_hostile_64_kb_line_is_decided_while_other_calls_go_on(fleet: Fleet) -> None:
    """What once stalled a worker's gate for tens of seconds (a quadratic fork-bomb
    pattern, nested lists of commands) is decided and refused like any other call."""
    hostile = ["a" * 65000, "true && " * 8000 + "true", "echo " + "{," * 32000]
    ends = fleet.run("walls", [*hostile, "uname -s"])
    assert ends[-1].data["status"] == "ok", ends[-1].data
    assert all(end.data["status"] in ("ok", "error", "denied") for end in ends[:-1])
