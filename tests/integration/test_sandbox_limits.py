"""Bounded work and the floor held by the operating system, through a real machine worker.

One machine, `bounded`, in mode bypass with no rules: the gate lets every call
through, so only the sandbox stands there. Its policy sets small limits (64
processes, 256 MiB of memory, 8 MiB per file, 16 MiB of /tmp) so each overrun is
cheap. A call that goes past a limit must fail with a note saying which, and the
worker must go on answering. Its home holds `.ssh/id_rsa`, its working directory a
`.env`, its writable grant a `.env.production`, all with secrets that no command may
print, however it names the file; the same commands on plain files next to them print
their contents, so each refusal is the floor's and not a broken command.
"""

from __future__ import annotations

import base64
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ..conftest import PolicyBase, run_tool_calls
from .conftest import stop_machines

pytestmark = pytest.mark.integration

MACHINE = "bounded"
PROCESSES, MEMORY_MB, FILE_MB, TMP_MB = 64, 256, 8, 16
SECRET = f"floor-secret-{uuid.uuid4().hex[:10]}"
PLAIN = f"plain-text-{uuid.uuid4().hex[:10]}"
# Fork 200 children that each note themselves in a file, then wait on a pipe the
# parent closes when done: all that started are alive together.
FORK_LOOP = """python3 -c "
import os, sys
r, w = os.pipe()
refused = 0
for i in range(200):
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        continue
    if pid == 0:
        os.close(w)
        with open(sys.argv[1], 'a') as log:
            log.write('x\\\\n')
        os.read(r, 1)
        os._exit(0)
os.close(w)
print('refused', refused)
" {log}"""


@dataclass
class Bounded:
    client: Client
    fake: FakeAnthropic
    fleet: LocalFleet
    base: Path  # outside /tmp, so the sandbox shows the real files
    grant: Path  # writable in the sandbox
    audit: Path
    policy: Path

    def run(self, commands: list[str], **fields: object) -> list[Event]:
        uses = [{"name": "execute_command", "input": {"command": c}} for c in commands]
        return run_tool_calls(self.client, self.fake, MACHINE, uses, **fields)


@pytest.fixture(scope="module")
def bounded(plain_base: PolicyBase, fake_model: FakeAnthropic) -> Iterator[Bounded]:
    base = Path(f"/var/tmp/cmdop-limits-{uuid.uuid4().hex[:8]}")
    home, cwd, grant = base / "home", base / "work", base / "grant"
    for directory in (home / ".ssh", home / "keys", cwd, grant):
        directory.mkdir(parents=True)
    for path in (home / ".ssh" / "id_rsa", cwd / ".env", grant / ".env.production"):
        path.write_text(f"{SECRET}\n")
    for path in (home / "keys" / "id_rsa", cwd / "plain.txt", grant / "plain.production"):
        path.write_text(f"{PLAIN}\n")
    audit = grant / "audit.log"
    policy = grant / "policy.toml"  # writable but for the sandbox's floor
    policy.write_text(
        f'mode = "bypass"\n[sandbox]\nwritable = ["{grant}"]\n[sandbox.limits]\n'
        f"max_processes = {PROCESSES}\nmax_memory_mb = {MEMORY_MB}\n"
        f"max_file_size_mb = {FILE_MB}\ntmp_size_mb = {TMP_MB}\n"
    )
    fleet = plain_base.fleet
    extra = {"CMDOP_POLICY_FILE": str(policy), "CMDOP_AUDIT_LOG": str(audit), "HOME": str(home)}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(cwd)  # the machine worker's working directory: the tools' too
            fleet.start_machine(MACHINE, extra)
        fleet.wait_ready([MACHINE], timeout_s=60)
        with Client(Settings(redis_url=plain_base.server.url)) as client:
            yield Bounded(client, fake_model, fleet, base, grant, audit, policy)
    finally:
        stop_machines(plain_base, [MACHINE])
        shutil.rmtree(base, ignore_errors=True)


def output(end: Event) -> str:
    return str(end.data["output"])


def test_the_start_log_says_how_each_limit_is_held(bounded: Bounded) -> None:
    log = bounded.fleet.workers[MACHINE].log_path.read_text()
    line = next(line for line in log.splitlines() if "tool call limits:" in line)
    assert f"processes {PROCESSES} (" in line and f"memory {MEMORY_MB} MiB (" in line
    assert f"file size {FILE_MB} MiB (RLIMIT_FSIZE)" in line


def test_a_fork_loop_stops_at_the_process_limit(bounded: Bounded) -> None:
    log = bounded.grant / f"forks-{uuid.uuid4().hex[:6]}"
    # First it tries to lift its own limit and to leave its cgroup for the root one:
    # the cgroup files are read-only inside.
    lift = "for f in /sys/fs/cgroup/pids/*/call-*/pids.max /sys/fs/cgroup/*/pids.max; "
    lift += "do echo max > $f; done 2>/dev/null; echo $$ > /sys/fs/cgroup/pids/cgroup.procs; "
    (end,) = bounded.run([lift + FORK_LOOP.format(log=log)])
    started = log.read_text().count("x")
    assert 0 < started <= PROCESSES, output(end)
    assert f"refused: process limit {PROCESSES} reached" in output(end), output(end)
    (after,) = bounded.run(["echo still-here"])
    assert after.data["status"] == "ok" and "still-here" in output(after)


def test_memory_past_the_limit_is_killed_with_a_note(bounded: Bounded) -> None:
    grab = "python3 -c \"b = b'x' * (512 << 20); print('allocated', len(b))\""
    small = "python3 -c \"b = b'x' * (64 << 20); print('allocated', len(b))\""
    big, fine = bounded.run([grab, small])
    assert big.data["status"] == "error", big.data
    assert "allocated" not in output(big)
    assert f"killed: memory limit {MEMORY_MB} MiB reached" in output(big)
    assert fine.data["status"] == "ok" and f"allocated {64 << 20}" in output(fine)
    assert bounded.fleet.workers[MACHINE].alive()


def test_tmp_fills_up_at_its_size(bounded: Bounded) -> None:
    # Files of 4 MiB, under the file size limit: /tmp itself runs out.
    fill = "for i in $(seq 16); do head -c 4194304 /dev/zero > /tmp/f$i || break; done; "
    fill += "du -sk /tmp | cut -f1"
    (end,) = bounded.run([fill])
    assert "No space left on device" in output(end), output(end)
    used_kib = int(output(end).split("--- stdout ---\n")[1].split()[0])
    assert used_kib <= TMP_MB * 1024


def test_a_file_past_the_size_limit_cannot_be_written(bounded: Bounded) -> None:
    by_python, by_dd = bounded.grant / "big-py", bounded.grant / "big-dd"
    write = f"python3 -c \"open('{by_python}', 'wb').write(b'x' * (32 << 20))\""
    dd = f"ulimit -f unlimited; dd if=/dev/zero of={by_dd} bs=1M count=32"  # cannot raise it
    python_end, dd_end, after = bounded.run([write, dd, "echo next-call"])
    assert "File too large" in output(python_end), output(python_end)
    assert f"killed: file size limit {FILE_MB} MiB reached" in output(dd_end), output(dd_end)
    assert by_python.stat().st_size <= FILE_MB << 20
    assert by_dd.stat().st_size <= FILE_MB << 20
    assert after.data["status"] == "ok" and "next-call" in output(after)


def _named(relative: str) -> str:
    """A shell word that names `relative` without spelling it (past the gate's text)."""
    return f'"$(echo {base64.b64encode(relative.encode()).decode()} | base64 -d)"'


READERS = [
    "cat {f}",
    "base64 {f} | base64 -d",
    'python3 -c "import sys; print(open(sys.argv[1]).read())" {f}',
    "cp {f} {grant}/copy-{i} && cat {grant}/copy-{i}",
    "dd if={f} status=none",
    "tar cf - {f} | tar xOf -",
    "head -c 1000 < {f}",
    "awk 1 {f}",
    "while read -r line; do echo $line; done < {f}",
]


def test_the_floor_holds_whatever_names_the_file(bounded: Bounded) -> None:
    grant = bounded.grant
    floor_files = [".env", "~/.ssh/id_rsa", f"{grant}/.env.production"]
    plain_files = ["plain.txt", "~/keys/id_rsa", f"{grant}/plain.production"]

    def commands(files: list[str], tag: str) -> list[str]:
        out = []
        for n, path in enumerate(files):
            home = path.startswith("~/")
            word = ("~/" if home else "") + _named(path.removeprefix("~/"))
            for i, reader in enumerate(READERS):
                out.append(reader.format(f=word, grant=grant, i=f"{tag}{n}-{i}"))
        return out

    hidden = commands(floor_files, "h")
    shown = commands(plain_files, "p")
    ends = bounded.run([*hidden, *shown, "python3 -c \"print(open('.'+'env').read())\""])
    assert all(end.data["status"] != "denied" for end in ends)  # the gate let all through
    leaked = [
        (c, output(e))
        for c, e in zip(hidden, ends[: len(hidden)], strict=True)
        if SECRET in output(e)
    ]
    assert leaked == []
    assert SECRET not in output(ends[-1]) and "Permission denied" in output(ends[-1])
    unread = [
        cmd for cmd, e in zip(shown, ends[len(hidden) :], strict=False) if PLAIN not in output(e)
    ]
    assert unread == []


def test_the_worker_audit_log_is_not_a_tool_s_to_read(bounded: Bounded) -> None:
    marker = f"audited-{uuid.uuid4().hex[:8]}"
    bounded.run([f"echo {marker}"])
    assert marker in bounded.audit.read_text()  # it is there to be read ...
    read = f"grep -o {marker} {bounded.audit}; echo $((6 * 7))-appended >> {bounded.audit}"
    (end,) = bounded.run([read])
    assert marker not in output(end)  # ... but not from the sandbox
    assert "42-appended" not in bounded.audit.read_text()


def test_the_worker_policy_is_readable_but_not_writable(bounded: Bounded) -> None:
    before = bounded.policy.read_text()
    (end,) = bounded.run([f"cat {bounded.policy}; echo '[rules]' >> {bounded.policy}"])
    assert "max_processes" in output(end)  # shown as it is ...
    assert "Read-only file system" in output(end)  # ... and kept as it is
    assert bounded.policy.read_text() == before
