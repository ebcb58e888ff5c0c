"""`machine.shell`: what a bash line runs, its wrappers stripped, and what makes it hazardous."""

from __future__ import annotations

import fnmatch

import pytest

from cmdop_worker.machine.shell import SimpleCommand, analyse, rm_root_targets


def innermost(command: str) -> list[tuple[str, ...]]:
    return [c.layers[-1] for c in analyse(command).commands]


# --- plain commands: exact argv, no hazards --------------------------------------

SAFE = [
    ("git status --short", [("git", "status", "--short")]),
    ("ls -la /var/log", [("ls", "-la", "/var/log")]),
    ("cat /etc/hostname", [("cat", "/etc/hostname")]),
    ("df -h", [("df", "-h")]),
    ("ps aux | head -5", [("ps", "aux"), ("head", "-5")]),
    (
        'journalctl -u nginx --since "1 hour ago"',
        [("journalctl", "-u", "nginx", "--since", "1 hour ago")],
    ),
    ("ls *.log 2>/dev/null", [("ls", "*.log")]),
    ("uptime && free -m", [("uptime",), ("free", "-m")]),
    ("ls ~ ~/x ~root", [("ls", "~", "~/x", "~root")]),
    ("ls -d [ab]* ?x", [("ls", "-d", "[ab]*", "?x")]),
    ("grep -E 'a|b' /var/log/syslog", [("grep", "-E", "a|b", "/var/log/syslog")]),
    ("awk '{print $1}' /etc/passwd", [("awk", "{print $1}", "/etc/passwd")]),
    ("ls >/dev/null 2>&1", [("ls",)]),
    ("ls 2>&- >&2 1>&2-", [("ls",)]),
    ("cat < /dev/null", [("cat",)]),
    ('ls > "/dev/null"', [("ls",)]),
    ("cat <<< hello", [("cat",)]),
    ("cat <<'EOF'\n$(id) `id` $HOME\nEOF", [("cat",)]),
    ("echo ok # $(reboot) is only a comment", [("echo", "ok")]),
    ("ls &", [("ls",)]),
    ("echo a |& cat", [("echo", "a"), ("cat",)]),
    ("echo ok\nuptime", [("echo", "ok"), ("uptime",)]),
    ("ls; (uptime)", [("ls",), ("uptime",)]),
    ("{ ls; uptime; }", [("ls",), ("uptime",)]),
    ("! grep -q x f", [("grep", "-q", "x", "f")]),
    ("echo a\\\nb", [("echo", "ab")]),
    ("echo a >/dev/null b 2>/dev/null c", [("echo", "a", "b", "c")]),
    ("find . -name '*.py' -exec grep -l foo {} \\;", None),
    ("echo \\{a,b\\} '{c,d}'", [("echo", "{a,b}", "{c,d}")]),
]


@pytest.mark.parametrize(("command", "argvs"), SAFE)
def test_safe_commands_have_exact_words_and_no_hazards(command, argvs):
    found = analyse(command)
    assert found.hazards == ()
    assert not found.parse_error
    assert all(c.literal for c in found.commands)
    if argvs is not None:
        assert [c.words for c in found.commands] == argvs


# --- quoting and decoding ------------------------------------------------------

WORDS = [
    ("echo $'\\x41\\101\\u00e9\\t'", ("echo", "AA\u00e9\t")),
    ("echo $'\\U0001F600\\e\\cA\\?'", ("echo", "\U0001f600\x1b\x01?")),
    ("echo $'a\\0b'", ("echo", "a")),  # bash cuts an ANSI-C string at NUL
    ("echo $'\\q\\x'", ("echo", "\\q\\x")),  # unknown escapes stay
    ("echo $'it\\'s'", ("echo", "it's")),
    ("echo $'\\xc3\\xa9'", ("echo", "\u00e9")),  # bytes, read as UTF-8
    ('echo $"hello" a$"b"c', ("echo", "hello", "abc")),
    ("echo 'it'\\''s'", ("echo", "it's")),
    ('echo "a\\"b\\$c\\\\d\\q"', ("echo", 'a"b$c\\d\\q')),
    ("echo a\\ b \\x", ("echo", "a b", "x")),
    ('echo "x\\\ny"', ("echo", "xy")),
    ("ls -- -rf", ("ls", "--", "-rf")),
]


@pytest.mark.parametrize(("command", "words"), WORDS)
def test_quote_removal_and_escape_decoding(command, words):
    found = analyse(command)
    assert [c.words for c in found.commands] == [words]
    assert found.hazards == ()


# --- hazards -----------------------------------------------------------------

HAZARDS = [
    # parameter expansion, every form (bash manual 3.5.3)
    "echo $HOME",
    "echo ${HOME}",
    "echo ${x:-default}",
    "echo ${x:=\\$\\(touch /tmp/p\\)}",
    "echo ${x:?message}",
    "echo ${x:+alt}",
    "echo ${x:1:2}",
    "echo ${#x}",
    "echo ${x#prefix} ${x%%suffix}",
    "echo ${x/a/b}",
    "echo ${x^^}",
    "echo ${x@P}",
    "echo ${x@E}",
    "echo ${x@Q}",
    "echo ${!x}",
    "echo ${!prefix*}",
    "echo ${y[x]}",
    "echo ${arr[@]}",
    "echo $1",
    'echo "$@"',
    "echo $# $? $$ $! $0 $_",
    'ls "${x}"',
    "ls ${x:=\\$\\(touch /tmp/p\\)}${x@P}",
    "cat ${x:=a[\\$\\(id\\)]} ${y[x]}",
    # command and process substitution (3.5.4, 3.5.6)
    "echo $(id)",
    "echo `id`",
    'echo "$(id)"',
    "diff <(ls) /dev/null",
    "tee >(cat) < /dev/null",
    "[[ -f $(id) ]]",
    # arithmetic (3.5.5, 6.5)
    "echo $((1+1))",
    "echo $[1+1]",
    "(( x = 1 ))",
    "if ((x)); then :; fi",
    "let x=1",
    "for ((i=0; i<3; i++)); do :; done",
    "[[ x -eq 1 ]]",
    # assignments and declarations
    "a[$(id)]=1",
    "x=1",
    "LD_PRELOAD=x.so ls",
    "GIT_PAGER='sh -c reboot' git log",
    "x=$(id) ls",
    "export FOO=bar",
    "declare -x FOO=bar",
    "typeset x",
    "local x",
    "readonly x",
    "unset PATH",
    "for f in *; do :; done",
    "select x in a b; do :; done",
    "read -r line",
    "mapfile -C callback lines",
    "printf -v x %s y",
    "[ -v 'a[$(id)]' ]",
    "test -v x",
    "env LD_PRELOAD=x.so ls",
    "sudo FOO=1 ls",
    # here-documents and here-strings
    "cat <<EOF\n$(id)\nEOF",
    "cat <<EOF\nplain\nEOF",
    'cat <<< "$x"',
    # code-running builtins and definitions
    "eval ls",
    "source ./x.sh",
    ". ./x.sh",
    "trap 'reboot' EXIT",
    "alias ls=reboot",
    "enable -f ./x.so x",
    "builtin eval ls",
    "f() { ls; }",
    "function f { ls; }",
    "coproc ls",
    "env -S 'ls -l'",
    "echo ls | sh",
    "bash script.sh",
    "bash + script.sh",
    "bash -x",
    "sudo -s",
    "su root",
    # redirections to files (reads too)
    "ls > out.txt",
    "ls >> out.txt",
    "ls >| out.txt",
    "cat < /etc/hostname",
    "ls &> out.txt",
    "ls &>> out.txt",
    "ls >& out.txt",
    "echo x > /dev/tcp/127.0.0.1/80",
    'ls > "$f"',
    "exec 3> out.txt",
    # brace expansion and names that are not literal
    "echo {a,b}",
    "echo {1..3}",
    "cp file{,.bak}",
    "git log --format={%h,%s}",
    "$cmd",
    '"$(echo reboot)"',
    "/usr/sbin/reb*t",
    "find . -exec /sbin/reb* \\;",
    # hazards inside code strings count
    "bash -c 'echo $HOME'",
    "sudo sh -c 'ls > /etc/x'",
]


@pytest.mark.parametrize("command", HAZARDS)
def test_hostile_input_has_a_hazard(command):
    found = analyse(command)
    assert found.hazards, found
    assert not found.parse_error


def test_a_quoted_heredoc_does_not_expand_but_an_unquoted_one_does():
    assert analyse("cat <<'EOF'\n$(reboot)\nEOF").hazards == ()
    assert analyse('cat <<"EOF"\n$(reboot)\nEOF').hazards == ()
    unquoted = analyse("cat <<EOF\n$(reboot)\nEOF")
    assert unquoted.hazards
    assert ("reboot",) in innermost("cat <<EOF\n$(reboot)\nEOF")


def test_non_literal_commands_are_marked_so():
    assert not analyse("echo $HOME").commands[0].literal
    assert not analyse("echo {a,b}").commands[0].literal
    assert analyse("ls *.log").commands[0].literal


# --- parse errors ---------------------------------------------------------------

PARSE_ERRORS = [
    "echo 'unterminated",
    'echo "unterminated',
    "echo $(",
    "echo `",
    "if true; then",
    "ls |",
    "ls &&",
    "(ls",
    "case x in",
    "ls\x00x",
    "ls\rreboot",
    "ls\x0creboot",
    "ls \ud800",
    "{ ls; } >/dev/null extra",
    "ls 3<>f",
    "ls !(a)",
]


@pytest.mark.parametrize("command", PARSE_ERRORS)
def test_malformed_input_is_a_parse_error_not_a_hazard(command):
    assert analyse(command).parse_error


# --- where commands are found ---------------------------------------------------

FOUND = [
    "ls | reboot",
    "ls && reboot",
    "ls || reboot",
    "ls; reboot",
    "ls & reboot",
    "ls\nreboot",
    "(reboot)",
    "{ reboot; }",
    "! reboot",
    "time reboot | cat",
    "if true; then reboot; fi",
    "if false; then :; elif true; then :; else reboot; fi",
    "while reboot; do :; done",
    "until false; do reboot; done",
    "for x in a; do reboot; done",
    "select x in a; do reboot; done",
    "case x in a) reboot;; esac",
    "f() { reboot; }",
    "function f { reboot; }",
    "echo $(reboot)",
    "echo `reboot`",
    'echo "$(reboot)"',
    "diff <(reboot) /dev/null",
    "tee >(reboot)",
    "x=$(reboot)",
    "a[$(reboot)]=1",
    "[[ -f $(reboot) ]]",
    "cat <<EOF\n$(reboot)\nEOF",
    "bash -c reboot",
    "sh -c 'ls; reboot'",
    "dash -c reboot",
    "zsh -c reboot",
    "bash -lc reboot",
    "bash -o pipefail -c 'reboot | cat'",
    "bash -c 'bash -c \"reboot\"'",
    "sudo bash -c reboot",
    "su -c reboot",
    "su - root -c reboot",
    "su root -c reboot",
    "su --command=reboot root",
    "runuser -l bob -c reboot",
    "eval reboot",
    "eval 'ls; reboot'",
    "watch reboot",
    "watch -n 5 'ls; reboot'",
    "flock /tmp/lock -c reboot",
    "env -S reboot",
    "find . -exec reboot \\;",
    "find . -execdir reboot {} +",
    "find . -ok reboot {} \\;",
    "find / -name x -exec sudo reboot \\;",
    "xargs sh -c reboot",
    "coproc reboot",
    "ls >/dev/null | reboot",
]


@pytest.mark.parametrize("command", FOUND)
def test_every_simple_command_is_found(command):
    assert ("reboot",) in innermost(command) or ("reboot", "{}") in innermost(command)


# --- wrappers -------------------------------------------------------------------

WRAPPED = [
    "env reboot now",
    "env -i -u HOME -C /tmp reboot now",
    "env -- reboot now",
    "env - reboot now",
    "command reboot now",
    "command -p reboot now",
    "exec reboot now",
    "exec -a name reboot now",
    "exec -cl reboot now",
    "sudo reboot now",
    "sudo -u root reboot now",
    "sudo -u root -g wheel -- reboot now",
    "sudo --user=root reboot now",
    "sudo --user root reboot now",
    "sudo -nu root reboot now",
    "sudo -C 3 -D /tmp -p prompt reboot now",
    "doas reboot now",
    "doas -u root reboot now",
    "nice reboot now",
    "nice -n 5 reboot now",
    "nice -n5 reboot now",
    "nice --adjustment=5 reboot now",
    "nice -5 reboot now",
    "ionice -c 3 reboot now",
    "ionice -c2 -n7 reboot now",
    "timeout 3 reboot now",
    "timeout -s KILL -k 5 3 reboot now",
    "timeout --signal=KILL 3s reboot now",
    "timeout --foreground --kill-after 5 3 reboot now",
    "xargs reboot now",
    "xargs -I{} reboot now",
    "xargs -I {} reboot now",
    "xargs -n 1 -P 4 reboot now",
    "xargs -0 -a list.txt reboot now",
    "xargs -d , -r reboot now",
    "nohup reboot now",
    "time reboot now",
    "time -p reboot now",
    "stdbuf -oL reboot now",
    "stdbuf -o L -e 0 reboot now",
    "setsid reboot now",
    "setsid -f reboot now",
    "chrt -f 10 reboot now",
    "chrt 10 reboot now",
    "taskset 0x3 reboot now",
    "taskset -c 0,1 reboot now",
    "busybox reboot now",
    "unbuffer reboot now",
    "watch -x reboot now",
    "watch -n 5 -x reboot now",
    "flock /tmp/lock reboot now",
    "flock -w 5 -n /tmp/lock reboot now",
    "chroot /mnt reboot now",
    "chroot --userspec=1:1 /mnt reboot now",
    "builtin reboot now",
]


@pytest.mark.parametrize("command", WRAPPED)
def test_each_wrapper_is_stripped_to_the_real_command(command):
    (found,) = analyse(command).commands
    assert found.layers[-1] == ("reboot", "now")
    assert found.name == "reboot"
    assert found.layers[0] == found.words


def test_nested_wrappers_strip_layer_by_layer():
    (found,) = analyse("sudo env nice -n 5 timeout 3 reboot").commands
    assert found.layers == (
        ("sudo", "env", "nice", "-n", "5", "timeout", "3", "reboot"),
        ("env", "nice", "-n", "5", "timeout", "3", "reboot"),
        ("nice", "-n", "5", "timeout", "3", "reboot"),
        ("timeout", "3", "reboot"),
        ("reboot",),
    )


@pytest.mark.parametrize(
    "command",
    [
        "sudo -u root timeout -s KILL 3 nohup nice -n 1 /usr/sbin/reboot -f",
        "doas env -i stdbuf -oL setsid -f chrt 5 taskset 1 ionice -c3 /usr/sbin/reboot -f",
        "exec command -p builtin time -p xargs -n1 busybox /usr/sbin/reboot -f",
    ],
)
def test_deep_wrapper_chains_reach_the_real_command(command):
    (found,) = analyse(command).commands
    assert found.layers[-1] == ("/usr/sbin/reboot", "-f")
    assert "reboot -f" in found.texts()


def test_command_v_only_looks_up_a_name():
    (found,) = analyse("command -v reboot").commands
    assert found.name == "command"
    assert found.layers == (("command", "-v", "reboot"),)


def test_a_shell_string_is_a_layer_of_its_own_and_its_commands_are_found():
    found = analyse("sudo bash -c 'ls -l; reboot'")
    assert found.commands[0].layers[-1] == ("bash", "-c", "ls -l; reboot")
    assert [c.words for c in found.commands[1:]] == [("ls", "-l"), ("reboot",)]


def test_find_exec_commands_are_commands_of_their_own():
    found = analyse("find /var -name '*.log' -exec gzip -9 {} \\; -execdir sudo rm {} +")
    assert [c.layers[-1] for c in found.commands[1:]] == [("gzip", "-9", "{}"), ("rm", "{}")]


def test_shell_strings_nest_only_to_a_bounded_depth():
    command = "reboot"
    for _ in range(12):
        command = f"eval {command!r}"
    found = analyse(command)
    assert "shell code nested too deeply" in found.hazards


# --- names and rule texts -------------------------------------------------------

NAMES = [
    "reboot now",
    "\\reboot now",
    "'reboot' now",
    '"reboot" now',
    '"re"boot now',
    "r''eboot now",
    "re\\boot now",
    "$'\\x72eboot' now",
    '$"reboot" now',
    "reb\\\noot now",
    "/usr/sbin/reboot now",
    "./reboot now",
    "../sbin/reboot now",
    "true && \\reboot now",
    "sudo /usr/sbin/reboot now",
    "env '/sbin/reboot' now",
]


@pytest.mark.parametrize("command", NAMES)
def test_names_normalise_so_a_rule_glob_matches(command):
    found = analyse(command).commands[-1]
    assert found.name == "reboot"
    assert any(fnmatch.fnmatchcase(text, "reboot*") for text in found.texts())
    assert "reboot now" in found.texts()


def test_texts_are_shell_quoted_layers():
    (found,) = analyse('sudo journalctl --since "1 hour ago"').commands
    assert found.texts() == (
        "sudo journalctl --since '1 hour ago'",
        "journalctl --since '1 hour ago'",
    )


def test_values_are_frozen():
    found = analyse("ls")
    with pytest.raises(AttributeError):
        found.parse_error = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        found.commands[0].words = ()  # type: ignore[misc]


# --- the rm -rf / floor ---------------------------------------------------------

ROOT_REMOVALS = [
    "rm -rf /",
    "rm -fr /*",
    "rm -r -f /",
    "rm --recursive --force /",
    "/bin/rm -R /",
    "rm --no-preserve-root -rf /tmp",
    "rm --no-pres -r /tmp",
    "rm --rec /",
    "\\rm -rf /",
    "sudo /bin/rm -rf /",
    "sudo -u root nice -n 5 rm -rf /",
    'rm -Rf "/"',
    "rm -rf //",
    "rm -rf /.",
    "rm -rf /usr/..",
    "rm -rf /.*",
    "rm -rf -- /",
    "rm / -rf",
    "rm >/dev/null -rf /",
    "true | rm >/dev/null -rf /",
    "2>/dev/null rm -rf /",
]
NOT_ROOT_REMOVALS = [
    "rm -rf /tmp/x",
    "rm -f /",
    "rm /",
    "rm -rf ./",
    "rm -rf '*'",
    "rm -- -rf /tmp",
    "ls -rf /",
    "echo rm -rf /",
    "rmdir -r /",
]


@pytest.mark.parametrize("command", ROOT_REMOVALS)
def test_rm_root_targets_catches_removing_the_root(command):
    assert any(rm_root_targets(c) for c in analyse(command).commands)


@pytest.mark.parametrize("command", NOT_ROOT_REMOVALS)
def test_rm_root_targets_leaves_other_removals(command):
    assert not any(rm_root_targets(c) for c in analyse(command).commands)


def test_rm_root_targets_sees_into_shell_strings():
    assert any(rm_root_targets(c) for c in analyse("bash -c 'cd / && rm -rf /'").commands)


def test_rm_root_targets_reads_the_innermost_layer():
    wrapped = SimpleCommand(("sudo", "rm", "-rf", "/"), True, (("sudo", "rm", "-rf", "/"),))
    assert not rm_root_targets(wrapped)  # a value built by hand, not by analyse: no layers
    stripped = SimpleCommand(wrapped.words, True, (*wrapped.layers, ("rm", "-rf", "/")))
    assert rm_root_targets(stripped)
