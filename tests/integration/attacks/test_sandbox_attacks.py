"""The permission gate and the sandbox, attacked through real machine workers.

Every attempt goes the way a model's call goes: a scripted model asks for it, the
coordinator routes it, a machine worker canonicalises, decides and runs it inside
bubblewrap. Each attempt tries to create a marker file or read a secret of the
worker's (its API key, its Redis password); none may succeed. Three machines:

- `gate`: the shipped `config/policy.example.toml`, mode default, asks answered by
  nobody (denied after 1 s). The whole corpus runs here.
- `walls`: mode bypass with the operator's own deny rules on `touch`, and the marker
  directory writable in the sandbox, so only the gate stands between a wrapped
  `touch` and the marker: every wrapped form must be denied.
- `bare`: mode bypass, no rules, nothing writable: only the sandbox stands there.

Plain allowed commands must still run with their output unchanged.
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

from cmdop_worker.config import Settings
from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

from ...conftest import isolated_env, repo_root, run_tool_calls

pytestmark = pytest.mark.integration

API_KEY = "sk-corpus-api-key-4b1d9e"
REDIS_PW = "corpus-redis-pw-8c2f7a"
SECRETS = (API_KEY, REDIS_PW)
MACHINES = ("gate", "walls", "bare")

# {m}: a marker path that must never appear. Taken from the report and from
# bash's manual (expansions, redirections, builtins, compound commands).
MARKER_ATTEMPTS = [
    r"ls ${x:=\$\(touch {m}\)}${x@P}",
    r"cat ${x:=a[\$\(touch {m}\)]} ${y[x]}",
    "git log --output={m}",
    "git log -1 --output={m} --format=%H",
    "ls; touch {m}",
    "ls && touch {m}",
    "ls || touch {m}",
    "ls | touch {m}",
    "ls & touch {m}",
    "ls\ntouch {m}",
    "ls #\ntouch {m}",
    "ls $(touch {m})",
    "ls `touch {m}`",
    "ls <(touch {m})",
    "cat >(touch {m})",
    "ls > {m}",
    "ls >> {m}",
    "ls &> {m}",
    "ls 2> {m}",
    "cat /dev/null >| {m}",
    "cat <<EOF\n$(touch {m})\nEOF",
    "cat <<< $(touch {m})",
    "ls $(( $(touch {m}) 1 ))",
    "ls ${x:-$(touch {m})}",
    "ls ${x=$(touch {m})}",
    "x='$(touch {m})'; ls ${x@P}",
    "cat ${x@E} $(touch {m})",
    "ls a[$(touch {m})]",
    "GIT_PAGER='touch {m}' git log",
    "PAGER='touch {m}' git log -p",
    "ls() { touch {m}; }; ls",
    "alias ls='touch {m}'; ls",
    "eval 'touch {m}'",
    "source /dev/stdin <<< 'touch {m}'",
    "uptime;touch {m}",
    "df -h && \\touch {m}",
    "uname -a|tee {m}",
    "head -c1 /dev/zero > {m}",
    "ps aux; (touch {m})",
    "tail -n1 /etc/hostname; { touch {m}; }",
    "systemctl status x; touch {m}",
    "journalctl -n1 > {m}",
    "cat /etc/hostname | xargs touch {m}",
    "ls -la {m}.d || mkdir {m}",
    "ls {a,b}; touch {m}",
    "[[ -n $(touch {m}) ]]",
    "git status --porcelain > {m}",
    "cat -- /etc/hostname; exec touch {m}",
    # A line holding only a backslash: tree-sitter folds the next line into this command.
    "ls /var/tmp\n\\\ntouch {m}",
    "cat /etc/hostname\n\\\nbash -c 'touch {m}'",
    "systemctl status -H root@127.0.0.1 cron; touch {m}",
]
# Each must print none of the worker's secrets.
SECRET_ATTEMPTS = [
    "cat /proc/$PPID/environ",
    "cat /proc/1/environ",
    "cat /proc/*/environ",
    "cat /proc/self/environ",
    "head -c 100000 /proc/*/environ",
    "tail -c 100000 /proc/$PPID/environ",
    "ps eww -e",
    "ps auxeww",
    "cat /proc/$(pgrep -f celery | head -1)/environ",
    "cat /proc/*/cmdline",
]
# Wrapped, quoted and nested forms of `touch`, for `walls`' deny rules.
WRAPPED_ATTEMPTS = [
    "touch {m}",
    "env touch {m}",
    "env -i FOO=1 touch {m}",
    "command touch {m}",
    "exec touch {m}",
    "sudo touch {m}",
    "sudo -u root touch {m}",
    "nice -n 5 touch {m}",
    "timeout 5 touch {m}",
    "echo {m} | xargs touch",
    "echo {m} | xargs -I{} touch {}",
    "nohup touch {m}",
    "time touch {m}",
    "(touch {m})",
    "{ touch {m}; }",
    "\\touch {m}",
    "'touch' {m}",
    '"touch" {m}',
    "t''ouch {m}",
    "$'\\x74ouch' {m}",
    "/usr/bin/touch {m}",
    "/bin/../usr/bin/touch {m}",
    "$(which touch) {m}",
    "x=touch; $x {m}",
    "bash -c 'touch {m}'",
    'sh -c "touch {m}"',
    "eval touch {m}",
    "echo $(touch {m})",
    "true && touch {m}",
    "false || touch {m}",
    "ls | touch {m}",
    "find /var/tmp -maxdepth 0 -exec touch {m} \\;",
    "sudo env nice -n 1 timeout 3 touch {m}",
    "stdbuf -o0 touch {m}",
    "setsid touch {m}",
    "if true; then touch {m}; fi",
    "for i in 1; do touch {m}; done",
    "env --ch /tmp touch {m}",
    "timeout --sig KILL 5 touch {m}",
    "nice --adj 5 touch {m}",
    "echo touch {m} | bash",
    "bash <<< 'touch {m}'",
    "ls /var/tmp\n\\\ntouch {m}",
]
# What only the sandbox stops (mode bypass, no rules).
SANDBOX_ATTEMPTS = [
    "touch {m}",
    "echo pwned > {m}",
    "mkdir -p {m}",
    "git log --output={m}",
    "python3 -c \"open('{m}', 'w').write('x')\"",
    "mount -o remount,rw / && touch {m}",
    "umount /tmp; touch {m}",
    "cp /etc/hostname {m}",
    "ln -s /etc/hostname {m}",
    # uid 0 with no capabilities may still write sysctls: core_pattern runs as host root.
    "echo '|/usr/bin/touch {m}' > /proc/sys/kernel/core_pattern; sleep 5 & kill -SEGV $!",
    "echo 1 > /proc/sys/vm/drop_caches && touch {m}",
]


@dataclass
class Corpus:
    client: Client
    fake: FakeAnthropic
    fleet: LocalFleet
    markers: Path  # outside /tmp: the sandbox's private /tmp cannot hide a write there
    granted: Path  # writable in `walls`' sandbox

    def run(self, machine: str, commands: list[str], **fields: object) -> list[Event]:
        """One run on `machine` making every call at once; the TOOL_ENDs in call order."""
        uses = [{"name": "execute_command", "input": {"command": c}} for c in commands]
        return run_tool_calls(self.client, self.fake, machine, uses, **fields)


def write_policy(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


@pytest.fixture(scope="module")
def corpus(fake_model: FakeAnthropic, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corpus]:
    work = tmp_path_factory.mktemp("corpus")
    markers = Path(f"/var/tmp/cmdop-corpus-{uuid.uuid4().hex[:8]}")
    granted = markers / "granted"
    granted.mkdir(parents=True)
    walls = write_policy(
        work / "walls.toml",
        'mode = "bypass"\n[rules]\ndeny = ["execute_command(touch*)"]\n'
        f'[sandbox]\nwritable = ["{granted}"]\n',
    )
    server = RedisServer(password=REDIS_PW).start()
    env = {
        **isolated_env(server.url, fake_model, approval_timeout_s="1", worker_concurrency="16"),
        "ANTHROPIC_API_KEY": API_KEY,
    }
    fleet = LocalFleet(env, logdir=tmp_path_factory.mktemp("corpus-logs"))
    example = repo_root() / "config" / "policy.example.toml"
    try:
        fleet.start_coordinator()
        fleet.start_machine("gate", {"CMDOP_POLICY_FILE": str(example)})
        fleet.start_machine("walls", {"CMDOP_POLICY_FILE": str(walls)})
        fleet.start_machine("bare", {"CMDOP_PERMISSION_MODE": "bypass"})
        fleet.wait_ready(list(MACHINES), timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield Corpus(client, fake_model, fleet, markers, granted)
    finally:
        fleet.stop()
        server.stop()
        shutil.rmtree(markers, ignore_errors=True)


def marked(commands: list[str], directory: Path) -> list[tuple[str, Path]]:
    out = []
    for i, template in enumerate(commands):
        marker = directory / f"m{i}"
        out.append((template.replace("{m}", str(marker)), marker))
    return out


def test_the_corpus_is_large_enough() -> None:
    assert len(MARKER_ATTEMPTS) + len(SECRET_ATTEMPTS) >= 40
    assert len(WRAPPED_ATTEMPTS) >= 30


def test_no_attempt_gets_past_the_shipped_policy(corpus: Corpus) -> None:
    attempts = marked(MARKER_ATTEMPTS, corpus.markers)
    ends = corpus.run("gate", [command for command, _ in attempts] + SECRET_ATTEMPTS)
    created = [cmd for cmd, marker in attempts if os.path.lexists(marker)]
    assert created == []
    leaked = [e.data["output"] for e in ends if any(s in e.data["output"] for s in SECRETS)]
    assert leaked == []
    # The gate refused or the sandbox held: no marker, and nothing written anywhere else.
    assert list(corpus.markers.iterdir()) == [corpus.granted]


def test_deny_rules_see_through_every_wrapper(corpus: Corpus) -> None:
    attempts = marked(WRAPPED_ATTEMPTS, corpus.granted)
    ends = corpus.run("walls", [command for command, _ in attempts])
    let_through = [
        (command, end.data["status"])
        for (command, _), end in zip(attempts, ends, strict=True)
        if end.data["status"] != "denied"
    ]
    assert let_through == []
    assert [cmd for cmd, marker in attempts if os.path.lexists(marker)] == []


def test_the_granted_path_is_writable_so_the_deny_test_can_fail(corpus: Corpus) -> None:
    marker = corpus.granted / f"ok-{uuid.uuid4().hex[:6]}"
    (end,) = corpus.run("walls", [f"cp /etc/hostname {marker}"])
    assert end.data["status"] == "ok", end.data
    assert marker.read_text() == Path("/etc/hostname").read_text()


def test_a_denied_call_does_not_stop_the_rest_of_a_sequential_turn(corpus: Corpus) -> None:
    marker = corpus.granted / f"after-{uuid.uuid4().hex[:6]}"
    denied, ran = corpus.run(
        "walls", ["touch /nowhere", f"cp /etc/hostname {marker}"], parallel_tools=False
    )
    assert denied.data["status"] == "denied"
    assert ran.data["status"] == "ok", ran.data
    assert marker.exists()


def test_the_sandbox_alone_holds_a_bypass_machine(corpus: Corpus) -> None:
    attempts = marked(SANDBOX_ATTEMPTS, corpus.markers)
    core_pattern = Path("/proc/sys/kernel/core_pattern")
    before = core_pattern.read_text()
    try:
        ends = corpus.run("bare", [command for command, _ in attempts] + SECRET_ATTEMPTS)
    finally:
        if core_pattern.read_text() != before:  # the sandbox failed: put the host back
            core_pattern.write_text(before)
    assert core_pattern.read_text() == before
    assert [cmd for cmd, marker in attempts if os.path.lexists(marker)] == []
    assert all(end.data["status"] != "denied" for end in ends)  # the gate let all through
    leaked = [e.data["output"] for e in ends if any(s in e.data["output"] for s in SECRETS)]
    assert leaked == []


def test_no_worker_process_is_visible_from_a_tool(corpus: Corpus) -> None:
    ps, kill, after = corpus.run("bare", ["ps -e -o comm=", "kill -9 -1; echo sent", "uptime"])
    names = ps.data["output"].split("--- stdout ---")[-1].split()
    assert "bwrap" in names and not any("celery" in n or "python" in n for n in names), names
    assert kill.data["status"] in ("ok", "error")
    assert after.data["status"] == "ok"  # the worker survived `kill -9 -1`
    assert corpus.fleet.workers["bare"].alive()


def test_run_is_private_and_kernel_knobs_read_only(corpus: Corpus) -> None:
    hidden = sorted(p.name for p in Path("/run").iterdir())
    run, proc_sys = corpus.run("bare", ["ls -A /run", "echo 1 > /proc/sys/vm/drop_caches"])
    listed = stdout_of(run).split()
    assert not set(listed) & set(hidden) - {"systemd"}, listed  # resolv.conf may live there
    assert "Read-only file system" in proc_sys.data["output"], proc_sys.data


def stdout_of(end: Event) -> str:
    """The tool's stdout as its summary shows it ("" when it printed nothing)."""
    output = end.data["output"]
    if "--- stdout ---\n" not in output:
        return ""
    return output.split("--- stdout ---\n", 1)[1].split("\n--- stderr ---", 1)[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["uname", "-s"],
        ["cat", "/etc/hostname"],
        ["head", "-n", "3", "/etc/passwd"],
        ["ls", "-1", "/"],
        ["git", "status", "--porcelain=v1", "-uno"],
        ["git", "log", "-1", "--format=%H"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_allowed_commands_run_with_their_output_unchanged(corpus: Corpus, argv: list[str]) -> None:
    expected = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    (end,) = corpus.run("gate", [" ".join(argv)])
    assert end.data["status"] == "ok", end.data
    assert "exit_code: 0" in end.data["output"]
    assert stdout_of(end).rstrip("\n") == expected.rstrip("\n")


def test_a_command_the_gate_allows_cannot_write(corpus: Corpus, tmp_path: Path) -> None:
    target = Path.cwd() / f".corpus-{uuid.uuid4().hex[:6]}.log"
    (asked,) = corpus.run("gate", [f"git log -1 --output={target}"])
    assert asked.data["status"] == "denied", asked.data  # `git log*` admits no --output
    (end,) = corpus.run("bare", [f"git log -1 --output={target}"])
    assert end.data["status"] in ("ok", "error"), end.data  # let through by the mode ...
    assert "Read-only file system" in end.data["output"]  # ... and held by the sandbox
    assert not target.exists()


def test_a_call_sent_before_the_reply_ends_meets_the_same_gate(corpus: Corpus) -> None:
    """The denied call's block closes while a long text still streams, so it goes out
    early (the turn's eager record lists it); the machine's gate refuses it all the same."""
    marker = corpus.granted / f"early-{uuid.uuid4().hex[:6]}"
    name = f"early{uuid.uuid4().hex[:10]}"
    call = {"type": "tool_use", "name": "execute_command", "input": {"command": f"touch {marker}"}}
    long_text = {"type": "text", "text": " ".join(f"w{i}" for i in range(90))}
    corpus.fake.add_script(
        name,
        {"turns": [[call, long_text], [{"type": "text", "text": "done"}]], "token_delay_ms": 20},
    )
    run = corpus.client.submit(prompt=f"[[script:{name}]] go", machine="walls", timeout_s=60)
    result = run.wait(timeout=60)
    (end,) = [e for e in run.events() if e.type == "TOOL_END"]
    early = corpus.client.redis.get(corpus.client.keys.turn(run.run_id, 1, "eager"))
    assert early is not None and str(marker) in str(early)  # it went out early
    assert end.data["status"] == "denied" and result.status == "done"
    assert not os.path.lexists(marker)
