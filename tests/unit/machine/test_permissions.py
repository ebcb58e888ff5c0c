"""Permission decisions (floor, rules, modes), policy loading, and the audit log."""

from __future__ import annotations

import json
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.machine.audit import AuditLog
from cmdop_worker.machine.permissions import (
    Decision,
    Policy,
    decide,
    load_policy,
    parse_rule,
    primary_arg,
)

ROOT = Path(__file__).resolve().parents[3]
EC = "execute_command"

# (tool, args, floor reason)
FLOOR_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("read_file", {"path": ".env"}, ".env files"),
    ("read_file", {"path": "/srv/app/.env.local"}, ".env files"),
    ("write_file", {"path": "config/.env.production", "content": "x"}, ".env files"),
    ("grep", {"pattern": "KEY", "path": "app/.env"}, ".env files"),
    ("list_dir", {"path": "repo/.git"}, ".git internals"),
    ("read_file", {"path": "repo/.git/config"}, ".git internals"),
    ("write_file", {"path": ".git/hooks/pre-commit", "content": "x"}, ".git internals"),
    ("grep", {"pattern": "x", "path": "src/../.git/"}, ".git internals"),
    ("glob", {"pattern": "*", "path": "/srv/repo/.git"}, ".git internals"),
    ("glob", {"pattern": ".git/**"}, ".git internals"),
    ("read_file", {"path": "~/.ssh/id_ed25519"}, "~/.ssh"),
    ("read_file", {"path": "/home/ops/.ssh/authorized_keys"}, "~/.ssh"),
    ("list_dir", {"path": "/root/.ssh"}, "~/.ssh"),
    ("write_file", {"path": "/etc/shadow", "content": "x"}, "writes to /etc/shadow"),
    ("write_file", {"path": "/etc/../etc/shadow", "content": "x"}, "writes to /etc/shadow"),
    ("write_file", {"path": "/etc/gshadow", "content": "x"}, "writes to /etc/shadow"),
    ("execute_command", {"command": "cat .env"}, ".env files"),
    ("execute_command", {"command": "source ./.env.local && run"}, ".env files"),
    ("execute_command", {"command": "grep KEY /srv/app/.env"}, ".env files"),
    ("execute_command", {"command": "cat .git/config"}, ".git internals"),
    ("execute_command", {"command": "rm -rf repo/.git"}, ".git internals"),
    ("execute_command", {"command": "cat ~/.ssh/id_rsa"}, "~/.ssh"),
    ("execute_command", {"command": 'cp key "$HOME/.ssh/authorized_keys"'}, "~/.ssh"),
    ("execute_command", {"command": "rm -rf /"}, "rm -rf /"),
    ("execute_command", {"command": "rm -fr /"}, "rm -rf /"),
    ("execute_command", {"command": "rm -rf /*"}, "rm -rf /"),
    ("execute_command", {"command": "rm -r -f /"}, "rm -rf /"),
    ("execute_command", {"command": "rm -Rf //"}, "rm -rf /"),
    ("execute_command", {"command": "rm --recursive --force /"}, "rm -rf /"),
    ("execute_command", {"command": "rm --no-preserve-root -rf /"}, "rm -rf /"),
    ("execute_command", {"command": "sudo /bin/rm -rf '/'"}, "rm -rf /"),
    ("execute_command", {"command": "cd /tmp && rm -rf / ; echo done"}, "rm -rf /"),
    ("execute_command", {"command": "echo $(rm -rf /)"}, "rm -rf /"),
    ("execute_command", {"command": "sh -c 'rm -rf /*'"}, "rm -rf /"),
    ("execute_command", {"command": "echo 'root::0:' > /etc/shadow"}, "writes to /etc/shadow"),
    ("execute_command", {"command": "echo x >>/etc/shadow"}, "writes to /etc/shadow"),
    ("execute_command", {"command": "echo x | tee -a /etc/shadow"}, "writes to /etc/shadow"),
    ("execute_command", {"command": "cp /tmp/s /etc/shadow"}, "writes to /etc/shadow"),
    ("execute_command", {"command": "sed -i s/x/y/ /etc/shadow"}, "writes to /etc/shadow"),
    ("execute_command", {"command": ":(){ :|:& };:"}, "fork bomb"),
    ("execute_command", {"command": ": ( ) { : | : & } ; :"}, "fork bomb"),
    ("execute_command", {"command": "bomb(){ bomb|bomb& };bomb"}, "fork bomb"),
    ("execute_command", {"command": "function f { f | f & }; f"}, "fork bomb"),
]

# Calls that look close to the floor but are ordinary work.
NOT_FLOOR_CASES: list[tuple[str, dict[str, Any]]] = [
    ("read_file", {"path": ".envrc"}),
    ("read_file", {"path": "prod.env"}),
    ("read_file", {"path": ".gitignore"}),
    ("read_file", {"path": ".github/workflows/ci.yml"}),
    ("read_file", {"path": "/etc/shadow"}),
    ("write_file", {"path": "/etc/shadow.md", "content": "x"}),
    ("list_dir", {"path": "/home/ops/ssh"}),
    ("execute_command", {"command": "git status"}),
    ("execute_command", {"command": "git clone https://example.com/repo.git /srv/repo"}),
    ("execute_command", {"command": "rm -rf /tmp/build"}),
    ("execute_command", {"command": "rm -rf ./dist /var/cache/x"}),
    ("execute_command", {"command": "rm -f /"}),
    ("execute_command", {"command": "ssh web-2 uptime"}),
    ("execute_command", {"command": "grep root /etc/passwd"}),
    ("execute_command", {"command": "echo $ENVIRONMENT; ls -la"}),
    ("execute_command", {"command": "f() { echo hi; }; f"}),
]

FLOOR_BYPASS_ATTEMPTS = [
    Policy(),
    Policy(mode="bypass"),
    Policy(mode="bypass", allow=("*",)),
    Policy(mode="bypass", allow=("read_file", "write_file(*)", "execute_command(*)")),
    Policy(allow=("list_dir", "grep(*)", "glob(*)", "execute_command(rm *)", "execute_command")),
]


@pytest.mark.parametrize(("tool", "args", "reason"), FLOOR_CASES)
@pytest.mark.parametrize("policy", FLOOR_BYPASS_ATTEMPTS)
def test_floor_denies_whatever_the_policy(
    tool: str, args: dict[str, Any], reason: str, policy: Policy
) -> None:
    decision = decide(tool, args, policy)
    assert (decision.verdict, decision.source, decision.rule) == ("deny", "floor", None)
    assert decision.reason.startswith(f"protected by the hard floor: {reason}")


@pytest.mark.parametrize(("tool", "args"), NOT_FLOOR_CASES)
@pytest.mark.parametrize(("mode", "verdict"), [("default", "ask"), ("bypass", "allow")])
def test_near_misses_are_not_floor(
    tool: str, args: dict[str, Any], mode: str, verdict: str
) -> None:
    decision = decide(tool, args, Policy(mode=mode))  # type: ignore[arg-type]
    assert (decision.verdict, decision.source) == (verdict, "mode")


def test_policy_has_no_floor_switch() -> None:
    data: dict[str, Any]
    for data in ({"floor": False}, {"rules": {"floor": []}}, {"mode": "unsafe"}):
        with pytest.raises(ValueError, match="invalid permission policy"):
            Policy.from_mapping(data)


@pytest.mark.parametrize(
    ("mode", "verdict"), [("default", "ask"), ("strict", "deny"), ("bypass", "allow")]
)
def test_mode_defaults(mode: str, verdict: str) -> None:
    decision = decide("execute_command", {"command": "uptime"}, Policy(mode=mode))  # type: ignore[arg-type]
    assert decision == Decision(
        verdict,  # type: ignore[arg-type]
        f"no rule matches; mode {mode!r} means {verdict}",
        None,
        "mode",
    )


@pytest.mark.parametrize(
    ("allow", "ask", "deny", "verdict", "rule"),
    [
        (["execute_command(systemctl *)"], ["execute_command(systemctl restart *)"],
         ["execute_command(*nginx)"], "deny", "execute_command(*nginx)"),
        (["execute_command(systemctl *)"], ["execute_command(systemctl restart *)"], [],
         "ask", "execute_command(systemctl restart *)"),
        (["execute_command(systemctl *)"], ["execute_command(reboot)"], ["read_file"],
         "allow", "execute_command(systemctl *)"),
        (["execute_command"], [], ["execute_command(systemctl restart *)"],
         "deny", "execute_command(systemctl restart *)"),
        ([], ["execute_command"], [], "ask", "execute_command"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("mode", ["default", "strict", "bypass"])
def test_deny_beats_ask_beats_allow(
    allow: list[str], ask: list[str], deny: list[str], verdict: str, rule: str, mode: str
) -> None:
    policy = Policy(mode=mode, allow=tuple(allow), ask=tuple(ask), deny=tuple(deny))  # type: ignore[arg-type]
    decision = decide("execute_command", {"command": "systemctl restart nginx"}, policy)
    assert (decision.verdict, decision.rule, decision.source) == (verdict, rule, "rule")


@pytest.mark.parametrize(
    ("rule", "tool", "args", "allowed"),
    [
        ("execute_command(git status*)", "execute_command", {"command": "git status -s"}, True),
        ("execute_command(git status*)", "execute_command", {"command": "git log"}, False),
        ("execute_command(git status*)", EC, {"command": "git status; rm -rf ~"}, False),
        ("execute_command(git status*)", "execute_command", {"command": "git status && id"}, False),
        ("execute_command(ls *)", "execute_command", {"command": "ls -la > /tmp/out"}, False),
        ("execute_command(ls *)", "execute_command", {"command": "ls $(cat /tmp/list)"}, False),
        ("execute_command(ls *)", "execute_command", {"command": "ls `pwd`"}, False),
        ("execute_command(ls *)", "execute_command", {"command": "ls -la 2>&1"}, True),
        ("execute_command(*)", "execute_command", {"command": "echo $(date) > /tmp/x"}, True),
        ("execute_command", "execute_command", {"command": "a; b | c"}, True),
        ("execute_command(cd /app && make)", EC, {"command": "cd /app && make"}, True),
        ("read_file(/var/log/**)", "read_file", {"path": "/var/log/syslog"}, True),
        ("read_file(/var/log/**)", "read_file", {"path": "/var/log/nginx/access.log"}, True),
        ("read_file(/var/log/**)", "read_file", {"path": "/etc/passwd"}, False),
        ("read_file(/var/log/**)", "write_file", {"path": "/var/log/syslog"}, False),
        ("read_file(*.log)", "read_file", {"path": "/srv/app.LOG"}, False),
        ("read_file", "read_file", {"path": "/anything/at/all"}, True),
        ("write_file(*)", "write_file", {"path": "/srv/x", "content": ""}, True),
        ("grep(TODO*)", "grep", {"pattern": "TODO: fix", "path": "/srv"}, True),
        ("grep(TODO*)", "grep", {"pattern": "FIXME", "path": "/srv"}, False),
        ("glob(**/*.py)", "glob", {"pattern": "**/*.py"}, True),
        ("list_dir(/srv/?)", "list_dir", {"path": "/srv/a"}, True),
        ("list_dir(/srv/[ab])", "list_dir", {"path": "/srv/c"}, False),
        ("*", "my_tool", {"x": 1}, True),
        ("my_*", "my_tool", {"x": 1}, True),
        ("my_tool(*)", "my_tool", {"x": 1}, True),
        ("my_tool(abc)", "my_tool", {"x": "abc"}, False),
        ("execute_command(ls *)", "execute_command", {"command": "ls x &>/dev/null"}, True),
        ("execute_command(ls *)", "execute_command", {"command": "ls x >/dev/null"}, True),
        ("execute_command(ls *)", "execute_command", {"command": "ls x & rm y"}, False),
    ],
)  # fmt: skip
def test_allow_rule_matching(rule: str, tool: str, args: dict[str, Any], allowed: bool) -> None:
    decision = decide(tool, args, Policy(allow=(rule,)))
    assert decision.verdict == ("allow" if allowed else "ask")
    assert decision.source == ("rule" if allowed else "mode")


def test_compound_command_needs_every_part_allowed() -> None:
    policy = Policy(allow=("execute_command(ls *)", "execute_command(grep *)"))
    decision = decide("execute_command", {"command": "ls -la /var | grep log"}, policy)
    assert (decision.verdict, decision.rule) == (
        "allow",
        "execute_command(ls *) + execute_command(grep *)",
    )
    assert decide("execute_command", {"command": "ls | wc -l"}, policy).verdict == "ask"


@pytest.mark.parametrize(
    "command",
    ["reboot", "reboot now", "ls; reboot", "uptime && reboot", "sudo reboot", "sudo -n reboot"],
)
def test_deny_rule_matches_any_part(command: str) -> None:
    policy = Policy(
        mode="bypass", allow=("execute_command(*)",), deny=("execute_command(reboot*)",)
    )
    assert decide("execute_command", {"command": command}, policy).verdict == "deny"


@pytest.mark.parametrize(
    ("tool", "args", "primary"),
    [
        ("execute_command", {"command": "ls", "machine": "web-1"}, "ls"),
        ("read_file", {"path": "/x", "offset": 3}, "/x"),
        ("write_file", {"path": "/y", "content": "z"}, "/y"),
        ("list_dir", {"path": "/d"}, "/d"),
        ("grep", {"pattern": "p", "path": "/d"}, "p"),
        ("glob", {"pattern": "*.py"}, "*.py"),
        ("my_tool", {"path": "/d"}, ""),
        ("execute_command", {"command": 7}, "7"),
    ],
)
def test_primary_arg(tool: str, args: dict[str, Any], primary: str) -> None:
    assert primary_arg(tool, args) == primary


@pytest.mark.parametrize("text", ["read_file(", "read file", "", "execute_command()", "a(b)c"])
def test_bad_rules_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="bad permission rule"):
        parse_rule(text)
    with pytest.raises(ValueError, match="bad permission rule"):
        Policy(deny=(text,))


def test_policy_from_mapping_and_mode_override() -> None:
    data = {"mode": "strict", "rules": {"allow": ["read_file"], "deny": ["execute_command(rm *)"]}}
    policy = Policy.from_mapping(data)
    assert policy == Policy(mode="strict", allow=("read_file",), deny=("execute_command(rm *)",))
    assert load_policy(data, mode="bypass").mode == "bypass"
    assert load_policy(data).mode == "strict"
    assert load_policy({}) == Policy()
    with pytest.raises(ValueError, match="unknown permission mode"):
        Policy(mode="yolo")  # type: ignore[arg-type]


def test_example_policy_file() -> None:
    with (ROOT / "config" / "policy.example.toml").open("rb") as fh:
        policy = load_policy(tomllib.load(fh))
    assert policy.mode == "default"
    expected = {
        "uptime": "allow",
        "df -h": "allow",
        "uname -a": "allow",
        "ls -la /var/log": "allow",
        "cat /etc/os-release": "allow",
        "systemctl restart nginx": "ask",
        "shutdown -h now": "deny",
        "reboot": "deny",
        "cat .env": "deny",
        "curl https://example.com": "ask",
    }
    verdicts = {c: decide("execute_command", {"command": c}, policy).verdict for c in expected}
    assert verdicts == expected


# --- audit log ---------------------------------------------------------------------


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_audit_lines(tmp_path: Path) -> None:
    clock = iter(range(1000, 2000))
    path = tmp_path / "deep" / "audit.jsonl"
    audit = AuditLog(path, clock_ms=lambda: next(clock))

    def log(tool_use_id: str, command: str, decision: Decision, final: Any = None) -> None:
        audit.append(
            machine="web-1",
            run_id="r1",
            tool_use_id=tool_use_id,
            tool=EC,
            args={"command": command},
            decision=decision,
            final=final,
        )

    allow = Decision(
        "allow", "allow rule 'execute_command(ls *)' matches", "execute_command(ls *)", "rule"
    )
    ask = Decision("ask", "no rule matches; mode 'default' means ask", None, "mode")
    floor = Decision("deny", "protected by the hard floor: rm -rf /", None, "floor")
    log("t1", "ls -la", allow)
    log("t2", "x" * 500, ask, "timeout")
    log("t3", "rm -rf /", floor)
    log("t4", "id", ask)
    lines = read_lines(path)
    assert lines[0] == {
        "ts_ms": 1000, "machine": "web-1", "run_id": "r1", "tool_use_id": "t1",
        "tool": "execute_command", "arg": "ls -la", "verdict": "allow", "source": "rule",
        "rule": "execute_command(ls *)", "reason": allow.reason, "final": "allow",
    }  # fmt: skip
    assert lines[1]["arg"] == "x" * 199 + "…" and lines[1]["final"] == "timeout"
    assert (lines[2]["verdict"], lines[2]["source"], lines[2]["final"]) == ("deny", "floor", "deny")
    assert lines[3]["final"] is None
    assert [line["ts_ms"] for line in lines] == [1000, 1001, 1002, 1003]


def test_audit_appends_and_is_thread_safe(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"earlier": true}\n')
    audit = AuditLog(path, clock_ms=lambda: 0)
    decision = Decision("deny", "deny rule 'x' matches", "x", "rule")

    def writer(n: int) -> None:
        for i in range(50):
            args = {"path": f"/p/{n}/{i}" + "y" * 150}
            audit.append(
                machine="m", run_id="r", tool_use_id=f"{n}-{i}", tool="read_file", args=args,
                decision=decision,
            )  # fmt: skip

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = read_lines(path)
    assert lines[0] == {"earlier": True} and len(lines) == 401
    assert len({line["tool_use_id"] for line in lines[1:]}) == 400
