"""The gate decides on the parsed command, not its text: one behaviour a row.

The same forms are attacked through real workers in
`tests/integration/test_sandbox_attacks.py`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cmdop_worker.machine.permissions import Policy, decide, load_policy

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = load_policy(tomllib.loads((ROOT / "config" / "policy.example.toml").read_text()))
DENY_REBOOT = Policy(mode="bypass", deny=("execute_command(reboot*)",))


def verdict(command: str, policy: Policy = EXAMPLE) -> str:
    return decide("execute_command", {"command": command}, policy).verdict


@pytest.mark.parametrize(
    "command",
    [
        "reboot",
        "env reboot",
        "env -i A=1 reboot",
        "(reboot)",
        "{ reboot; }",
        "\\reboot",
        "'reboot'",
        '"re"boot',
        "r''eboot",
        "$'\\x72eboot'",
        "/usr/sbin/reboot",
        "/sbin/../usr/sbin/reboot",
        "sudo reboot",
        "sudo -u root reboot",
        "command reboot",
        "exec reboot",
        "nice -n 5 reboot",
        "timeout 3 reboot",
        "nohup reboot",
        "time reboot",
        "echo now | xargs reboot",
        "bash -c 'reboot'",
        'sh -c "sleep 1; reboot"',
        "eval reboot",
        "echo $(reboot)",
        "ls; reboot",
        "true && reboot",
        "false || reboot",
        "if true; then reboot; fi",
        "f() { reboot; }; f",
        "find / -maxdepth 0 -exec reboot \\;",
        "sudo env nice -n 1 timeout 3 /usr/sbin/reboot -f",
    ],
)
def test_deny_rules_see_every_simple_command_through_wrappers(command: str) -> None:
    assert verdict(command, DENY_REBOOT) == "deny"
    assert verdict(command) == "deny"  # the shipped policy denies reboot* too


@pytest.mark.parametrize("command", ["x=reboot; $x", "$(echo reboot)", "`printf reboot`", "ls 'a"])
def test_a_computed_or_unreadable_command_is_asked_even_in_bypass(command: str) -> None:
    assert verdict(command, DENY_REBOOT) == "ask"
    assert verdict(command, Policy(mode="bypass")) == "allow"  # no deny rule to check


@pytest.mark.parametrize(
    "command",
    [
        r"ls ${x:=\$\(touch /tmp/p\)}${x@P}",
        r"cat ${x:=a[\$\(id\)]} ${y[x]}",
        "ls $HOME",
        "ls ${HOME}",
        "ls $(id)",
        "ls `id`",
        "cat <(id)",
        "ls > /tmp/out",
        "ls >> out",
        "cat < /etc/shadow",
        "cat <<EOF\n$(id)\nEOF",
        "ls $((1+1))",
        "LD_PRELOAD=/tmp/x.so ls",
        "GIT_PAGER='sh -c id' git log",
        "ls() { id; }; ls",
        "ls {a,b}",
        "ls; id",
        "ls && id",
        "ls | sh",
        "ls 'unterminated",
    ],
)
def test_allow_rules_never_admit_what_could_run_code_or_name_a_hidden_file(command: str) -> None:
    assert verdict(command) == "ask"


@pytest.mark.parametrize(
    "command",
    [
        "ls -la /var/log",
        "ls *.log 2>/dev/null",
        "cat /etc/hostname",
        "df -h && free -m",
        "ps aux | head -5",
        "git status --short",
        "git log --oneline -5",
        "journalctl -u nginx --since '1 hour ago'",
        "uname -a",
        "tail -n 50 /var/log/syslog 2>&1",
        "cat -n <<'EOF'\n$(id)\nEOF",
    ],
)
def test_plain_look_around_commands_are_allowed(command: str) -> None:
    assert verdict(command) == "allow"


def test_an_allow_rule_matches_words_as_written_not_a_stripped_wrapper() -> None:
    policy = Policy(allow=("execute_command(systemctl status *)",))
    assert verdict("systemctl status nginx", policy) == "allow"
    assert verdict("sudo systemctl status nginx", policy) == "ask"
    assert verdict("/tmp/evil/systemctl status nginx", policy) == "ask"
    assert verdict("systemctl 'status nginx; id'", policy) == "ask"


@pytest.mark.parametrize(
    ("tool", "args", "expected"),
    [
        ("grep", {"pattern": "error", "path": "/var/log/nginx"}, "allow"),
        ("grep", {"pattern": "root", "path": "/etc"}, "ask"),
        ("grep", {"pattern": "/var/log/*", "path": "/etc"}, "ask"),
        ("glob", {"pattern": "*.log", "path": "/var/log"}, "allow"),
        ("glob", {"pattern": "*", "path": "/root"}, "ask"),
    ],
)
def test_grep_and_glob_path_rules_confine_the_search_root(
    tool: str, args: dict[str, str], expected: str
) -> None:
    policy = Policy(allow=("grep(/var/log/*)", "glob(/var/log*)"))
    assert decide(tool, args, policy).verdict == expected


def test_a_deny_rule_on_a_path_meets_the_search_root() -> None:
    policy = Policy(mode="bypass", deny=("grep(/etc/*)",))
    assert decide("grep", {"pattern": "x", "path": "/etc/ssl"}, policy).verdict == "deny"


def test_the_policy_file_sets_the_sandbox() -> None:
    policy = load_policy(
        {"sandbox": {"network": False, "writable": ["/srv"], "approved_writable": []}}
    )
    assert (policy.sandbox.network.mode, policy.sandbox.writable) == ("none", ("/srv",))
    assert EXAMPLE.sandbox.writable == () and EXAMPLE.sandbox.network.mode == "any"
    with pytest.raises(ValueError, match="sandbox"):
        load_policy({"sandbox": {"writeable": ["/"]}})


@pytest.mark.parametrize(
    "command",
    [
        "ls /var/tmp\n\\\nid",
        "cat /etc/hostname\n\\\nbash -c 'id'",
        "git status\n\\\nperl -e 1",
    ],
)
def test_a_line_holding_only_a_backslash_starts_a_command_the_rules_did_not_see(
    command: str,
) -> None:
    assert verdict(command) == "ask"
    assert verdict(command.replace("id", "reboot"), DENY_REBOOT) == "ask"


@pytest.mark.parametrize(
    "command",
    [
        "echo reboot | bash",
        "bash <<<reboot",
        "x='a[$(reboot >&2)]'; ((x))",
        "PS4='$(reboot >&2)'; set -x; :",
        "env --ch /tmp reboot",
        "env --split=reboot",
        "timeout --sig KILL 5 reboot",
        "nice --adj 5 reboot",
        "sudo --us root reboot",
        "su --comm=reboot",
        "sudo -a x reboot",
    ],
)
def test_bypass_with_deny_rules_asks_about_what_the_rules_cannot_see(command: str) -> None:
    assert verdict(command, DENY_REBOOT) in ("ask", "deny")


@pytest.mark.parametrize(
    "command",
    [
        "cat /srv/app/.en? /srv/app/.ss[h]/id_rsa",
        "cat /srv/app/.gi*/config",
        "cat .e''nv",
        "cat .e\\nv",
    ],
)
def test_the_floor_sees_the_words_bash_will_pass(command: str) -> None:
    assert decide("execute_command", {"command": command}, EXAMPLE).source == "floor"


@pytest.mark.parametrize(
    "command",
    [
        "systemctl status -H root@10.0.0.1 cron",
        "systemctl status --host=db cron",
        "journalctl --rotate",
        "journalctl --rot",
        "journalctl --vacuum-size=1M",
        "git log --ext-diff",
    ],
)
def test_options_by_which_a_look_around_command_acts_are_not_allowed(command: str) -> None:
    assert verdict(command) == "ask"


@pytest.mark.parametrize(
    "command",
    ["systemd-run reboot", "pkexec reboot", "script -qc reboot /dev/null", "strace -f reboot"],
)
def test_programs_that_launch_another_are_opaque_to_deny_rules(command: str) -> None:
    assert verdict(command, DENY_REBOOT) == "ask"
