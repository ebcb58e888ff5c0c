"""An outside tester's attacks on the gate, through real machine workers.

Three kinds, each trying to create a marker (`touch -t 200101010000 MARK`):

- programs that run a program they are given: a compiler driver's `-wrapper`, `ctest
  -S`, `cpack --config`, `prove`, `sdiff --diff-program`, `logsave`;
- a program the sandbox could have written, run by its path: touch copied or linked
  into /tmp or a writable directory, python copied under another name, bash linked, a
  script written by write_file and made executable, a name found through a changed PATH;
- a hostile repository's own git config (`core.fsmonitor`, `gpg.program` with
  `log.showSignature`) under allow rules for `git status*` and `git log*`.

Machines, the marker directory writable in each one's sandbox, so only the gate (and
for git, the call's environment) stands between an attempt and its marker:

- `open`: mode bypass, no rules. Every attempt creates its marker: each is real.
- `walls`: mode bypass, deny `touch*` and `rm*`: none may (asked about, nobody answers).
- `pathed`: as `walls`, its worker's PATH leading with a directory in the writable grant.
- `spaced`: mode bypass, deny `touch *`, a rule that needs an argument to match.
- `reader`: mode default, allow `cd *`, `git status*`, `git log*`: git runs, prints its
  usual output, and runs none of the repository's programs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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

T = "-t 200101010000"
SH_MARK = f"#!/bin/sh\ntouch {T} {{m}}\n"
WRAP = f"-wrapper /bin/sh,-c,'touch {T} {{m}}',--"

# (command, files the test writes first: suffix -> content). {m}: the marker.
PROGRAM_ATTEMPTS: list[tuple[str, dict[str, str]]] = [
    (f"gcc {WRAP} -E -x c /dev/null", {}),
    (f"cc {WRAP} -E -x c /dev/null", {}),
    (f"c99 {WRAP} -E -x c /dev/null", {}),
    (f"cpp {WRAP} -x c /dev/null", {}),
    (f"g++ {WRAP} -E -x c /dev/null", {}),
    (f"x86_64-linux-gnu-gcc-12 {WRAP} -E -x c /dev/null", {}),
    ("ctest -S {m}.cmake", {".cmake": f"execute_process(COMMAND touch {T} {{m}})\n"}),
    ("cpack --config {m}.cmake", {".cmake": f"execute_process(COMMAND touch {T} {{m}})\n"}),
    ("prove {m}.t", {".t": f'system("touch {T} {{m}}"); print "1..0\\n";\n'}),
    ("sdiff --diff-program={m}.sh /etc/hostname /etc/hostname", {".sh": SH_MARK}),
    (f"logsave /dev/null touch {T} {{m}}", {}),
]
PLANTED_ATTEMPTS: list[tuple[str, dict[str, str]]] = [
    (f"cp /usr/bin/touch /tmp/zz && /tmp/zz {T} {{m}}", {}),
    (f"ln -s /usr/bin/touch /tmp/yy && /tmp/yy {T} {{m}}", {}),
    (f"cp /usr/bin/touch {{m}}.bin && {{m}}.bin {T} {{m}}", {}),
    (f"cp /usr/bin/touch {{m}}.bin && cd {{d}} && ./{{n}}.bin {T} {{m}}", {}),
    (
        "cp /usr/bin/python3.11 /tmp/notpy && /tmp/notpy -c"
        ' \'import os; open("{m}", "w").close(); os.utime("{m}", (978307200, 978307200))\'',
        {},
    ),
    (f"ln -s /bin/bash /tmp/q && /tmp/q -c 'touch {T} {{m}}'", {}),
    ("chmod 755 {m}.sh && {m}.sh", {".sh": SH_MARK}),
    (f"mkdir {{m}}.d && cp /usr/bin/touch {{m}}.d/tt && PATH={{m}}.d tt {T} {{m}}", {}),
    (f"mkdir {{m}}.d && cp /usr/bin/touch {{m}}.d/tt && export PATH={{m}}.d; tt {T} {{m}}", {}),
    (f"cp /usr/bin/touch {{m}}.bin && hash -p {{m}}.bin ls; ls {T} {{m}}", {}),
    (f"cp /usr/bin/touch {{m}}.bin && env {{m}}.bin {T} {{m}}", {}),
]
# Commands xargs runs with the words it reads: `touch` meets a rule `touch *` only as the
# `touch x` that xargs makes of it.
XARGS_ATTEMPTS: list[tuple[str, dict[str, str]]] = [
    (f"echo {T} {{m}} | xargs touch", {}),
    (f"echo {T} {{m}} | xargs -n 3 touch", {}),
    (f"echo {T} {{m}} | xargs /usr/bin/touch", {}),
    (f"echo {T} {{m}} | xargs nice touch", {}),
]
READER = (
    'mode = "default"\n[rules]\n'
    'allow = ["execute_command(cd *)", "execute_command(git status*)",'
    ' "execute_command(git log*)"]\n'
)


@dataclass
class Fleet:
    client: Client
    fake: FakeAnthropic
    markers: Path  # writable in every machine's sandbox

    def run(self, machine: str, uses: list[dict[str, object]]) -> list[Event]:
        return run_tool_calls(self.client, self.fake, machine, uses)

    def commands(self, machine: str, commands: list[str]) -> list[Event]:
        return self.run(machine, [command_use(c) for c in commands])


def command_use(command: str) -> dict[str, object]:
    return {"name": "execute_command", "input": {"command": command}}


@pytest.fixture(scope="module")
def fleet(
    attack_base: PolicyBase,
    fake_model: FakeAnthropic,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("outsider")
    markers = Path(f"/var/tmp/cmdop-outsider-{uuid.uuid4().hex[:8]}")
    markers.mkdir(parents=True)
    writable = f'[sandbox]\nwritable = ["{markers}"]\n'
    policies = {
        "open": 'mode = "bypass"\n' + writable,
        "walls": 'mode = "bypass"\n[rules]\n'
        'deny = ["execute_command(touch*)", "execute_command(rm*)"]\n' + writable,
        "reader": READER + writable,
        "pathed": 'mode = "bypass"\n[rules]\n'
        'deny = ["execute_command(touch*)", "execute_command(rm*)"]\n' + writable,
        "spaced": 'mode = "bypass"\n[rules]\ndeny = ["execute_command(touch *)"]\n' + writable,
    }
    (markers / "bin").mkdir()
    paths = {"pathed": {"PATH": f"{markers / 'bin'}:{os.environ['PATH']}"}}
    try:
        with attack_base.machines(work, policies, paths) as client:
            yield Fleet(client, fake_model, markers)
    finally:
        shutil.rmtree(markers, ignore_errors=True)


def prepared(
    fleet: Fleet, machine: str, attempts: list[tuple[str, dict[str, str]]]
) -> list[tuple[str, Path]]:
    """Each attempt's command and marker, its files written beside the marker."""
    directory = fleet.markers / f"{machine}-{uuid.uuid4().hex[:6]}"
    directory.mkdir()
    found = []
    for i, (template, files) in enumerate(attempts):
        marker = directory / f"m{i}"
        fill = {"{m}": str(marker), "{d}": str(directory), "{n}": marker.name}
        for suffix, content in files.items():
            path = Path(f"{marker}{suffix}")
            path.write_text(_filled(content, fill))
            path.chmod(0o755)
        found.append((_filled(template, fill), marker))
    return found


def _filled(text: str, fill: dict[str, str]) -> str:
    for key, value in fill.items():
        text = text.replace(key, value)
    return text


def attack(
    fleet: Fleet, machine: str, attempts: list[tuple[str, dict[str, str]]]
) -> tuple[list[str], list[tuple[str, str]]]:
    """Run every attempt on `machine`: those whose marker appeared (a file dated 2001),
    and those whose call was not refused."""
    ready = prepared(fleet, machine, attempts)
    ends = fleet.commands(machine, [command for command, _ in ready])
    created = [
        command
        for command, marker in ready
        if os.path.lexists(marker) and marker.stat().st_mtime < 10**9
    ]
    passed = [
        (command, end.data["status"])
        for (command, _), end in zip(ready, ends, strict=True)
        if end.data["status"] != "denied"
    ]
    return created, passed


ALL = PROGRAM_ATTEMPTS + PLANTED_ATTEMPTS + XARGS_ATTEMPTS


def test_every_attempt_really_creates_its_marker_when_nothing_stops_it(fleet: Fleet) -> None:
    created, _ = attack(fleet, "open", ALL)
    assert len(created) == len(ALL), created


def test_a_program_given_a_program_runs_nothing_past_deny_rules(fleet: Fleet) -> None:
    created, passed = attack(fleet, "walls", PROGRAM_ATTEMPTS)
    assert created == []
    assert passed == []


def test_a_command_xargs_runs_meets_deny_rules_with_the_words_it_appends(fleet: Fleet) -> None:
    created, passed = attack(fleet, "spaced", XARGS_ATTEMPTS)
    assert created == []
    assert passed == []


def test_a_program_the_sandbox_could_have_written_runs_nothing_past_deny_rules(
    fleet: Fleet,
) -> None:
    created, passed = attack(fleet, "walls", PLANTED_ATTEMPTS)
    assert created == []
    assert passed == []


def test_a_script_made_by_write_file_is_not_run_past_deny_rules(fleet: Fleet) -> None:
    script = fleet.markers / f"w-{uuid.uuid4().hex[:6]}.sh"
    marker = Path(f"{script}.mark")
    content = f"#!/bin/sh\ntouch {T} {marker}\n"
    (wrote,) = fleet.run(
        "walls", [{"name": "write_file", "input": {"path": str(script), "content": content}}]
    )
    assert wrote.data["status"] == "ok", wrote.data
    (ran,) = fleet.commands("walls", [f"chmod 755 {script} && {script}"])
    assert ran.data["status"] == "denied", ran.data
    assert not os.path.lexists(marker)
    (ran,) = fleet.commands("open", [f"chmod 755 {script} && {script}"])
    assert ran.data["status"] == "ok", ran.data
    assert os.path.lexists(marker)


def test_a_bare_name_finds_no_program_planted_in_a_writable_directory_on_path(
    fleet: Fleet,
) -> None:
    """The worker's PATH leads with a directory the sandbox may write: a call let through
    by the mode plants `ls` and `tt` there, and runs them by their bare names."""
    directory = fleet.markers / f"pathed-{uuid.uuid4().hex[:6]}"
    directory.mkdir()
    bin_dir = fleet.markers / "bin"
    attempts = [
        f"cp /usr/bin/touch {bin_dir}/tt && tt {T} {directory}/m0",
        f"cp /usr/bin/touch {bin_dir}/ls && ls {T} {directory}/m1",
    ]
    ends = fleet.commands("pathed", attempts)
    assert [e.data["status"] for e in ends] != ["denied", "denied"]  # the mode let them run
    assert sorted(p.name for p in directory.iterdir()) == []
    assert os.access(bin_dir / "tt", os.X_OK)  # planted, and runs by its path
    (end,) = fleet.commands("open", [f"{bin_dir}/tt {T} {directory}/m2"])
    assert end.data["status"] == "ok", end.data
    assert sorted(p.name for p in directory.iterdir()) == ["m2"]


def hostile_repo(root: Path) -> tuple[Path, Path, Path]:
    """A repository whose config runs programs on `git status` and `git log`, and whose
    last commit carries a signature: (repo, fsmonitor's marker, gpg.program's marker)."""
    repo, fsmonitor, gpg = root / "repo", root / "fsmonitor.mark", root / "gpg.mark"
    repo.mkdir()
    git = ["git", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("x\n")
    subprocess.run([*git, "add", "f"], check=True)
    who = ["-c", "user.name=n", "-c", "user.email=n@example.org"]
    subprocess.run([*git, *who, "commit", "-qm", "first"], check=True)
    tree = _git_out(git, "rev-parse", "HEAD^{tree}")
    parent = _git_out(git, "rev-parse", "HEAD")
    body = (
        f"tree {tree}\nparent {parent}\nauthor n <n@example.org> 1 +0000\n"
        "committer n <n@example.org> 1 +0000\ngpgsig -----BEGIN PGP SIGNATURE-----\n"
        " \n x\n -----END PGP SIGNATURE-----\n\nsigned commit\n"
    )
    signed = subprocess.run(
        [*git, "hash-object", "-t", "commit", "-w", "--stdin"],
        input=body,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run([*git, "update-ref", "HEAD", signed], check=True)
    fake = repo / ".gpgfake"
    fake.write_text(f"#!/bin/sh\ntouch {T} {gpg}\nexit 1\n")
    fake.chmod(0o755)
    for key, value in (
        ("core.fsmonitor", f"touch {T} {fsmonitor}; false"),
        ("gpg.program", "./.gpgfake"),
        ("log.showSignature", "true"),
    ):
        subprocess.run([*git, "config", key, value], check=True)
    return repo, fsmonitor, gpg


def _git_out(git: list[str], *args: str) -> str:
    return subprocess.run([*git, *args], capture_output=True, text=True, check=True).stdout.strip()


def test_git_runs_none_of_a_hostile_repositorys_programs_under_its_allow_rules(
    fleet: Fleet,
) -> None:
    root = fleet.markers / f"git-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    repo, fsmonitor, gpg = hostile_repo(root)
    # The repository is real: git as anyone runs it runs both programs.
    subprocess.run(["git", "status", "--short"], cwd=repo, capture_output=True, check=True)
    subprocess.run(["git", "log", "-1"], cwd=repo, capture_output=True, check=False)
    assert fsmonitor.exists() and gpg.exists()
    fsmonitor.unlink()
    gpg.unlink()
    status, log = fleet.commands(
        "reader", [f"cd {repo} && git status --short", f"cd {repo} && git log -1"]
    )
    assert (status.data["status"], log.data["status"]) == ("ok", "ok"), (status.data, log.data)
    assert "?? .gpgfake" in status.data["output"]
    assert "signed commit" in log.data["output"]
    assert not fsmonitor.exists()
    assert not gpg.exists()


def test_in_the_sandbox_only_the_calls_git_settings_stand_in_the_way(fleet: Fleet) -> None:
    """With the settings removed from its environment, the same git in the same
    sandbox runs the repository's programs: the settings are what stops them."""
    root = fleet.markers / f"git-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    repo, fsmonitor, gpg = hostile_repo(root)
    unset = "env -u GIT_CONFIG_COUNT"
    fleet.commands(
        "open", [f"cd {repo} && {unset} git status --short", f"cd {repo} && {unset} git log -1"]
    )
    assert fsmonitor.exists() and gpg.exists()
