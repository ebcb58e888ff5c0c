"""The table of programs that run code or write files: one program and option a row,
decided as the gate decides (`permissions.decide`), the reading forms beside them.

The same attempts run through real workers in
`tests/integration/test_code_running_attacks.py`.
"""

from __future__ import annotations

import pytest

from cmdop_worker.machine.permissions import Policy, decide
from cmdop_worker.machine.programs import PROGRAMS, program_use
from cmdop_worker.machine.shell import analyse

ALLOWED = (
    "sed awk gawk mawk find tar sort xargs git env rsync zip make less more man perl python3"
    " node ruby vim ed ssh scp sftp curl wget dd openssl split apt pip npm crontab cat echo"
    " pip3 systemctl journalctl nice timeout docker kubectl rpm go ksh93 tcsh sudo pager"
    " ssh-agent proxychains4 java"
)
ALLOW_ALL = Policy(allow=tuple(f"execute_command({p} *)" for p in ALLOWED.split()))
DENY_TOUCH = Policy(mode="bypass", deny=("execute_command(touch*)",))
ASK_TOUCH = Policy(mode="bypass", ask=("execute_command(touch*)",))


def verdict(command: str, policy: Policy) -> str:
    return decide("execute_command", {"command": command}, policy).verdict


# (command, the words its reason names): code a rule's text cannot show.
CODE = [
    ("echo 'touch M' | xargs -I{} sh -c {}", "xargs"),
    ("echo touch M | xargs env", "xargs"),
    ("echo touch M | xargs timeout 5", "xargs"),
    ("xargs -I% env % M", "xargs"),
    ("xargs find", "xargs"),
    ("git -c alias.x='!touch M' x", "alias.x"),
    ("git -c core.pager='touch M' log", "core.pager"),
    ("git -c core.sshCommand='touch M' fetch", "core.sshcommand"),
    ("git -c core.editor=vim commit", "core.editor"),
    ("git -c core.fsmonitor='touch M' status", "core.fsmonitor"),
    ("git -c core.hooksPath=/tmp/h commit", "core.hookspath"),
    ("git -c diff.external=x diff", "diff.external"),
    ("git -c filter.a.clean=x add .", "filter.a.clean"),
    ("git --exec-path=/tmp/x status", "--exec-path"),
    ("git -C /tmp/repo status", "-C"),
    ("git --git-dir=/tmp/r/.g log", "--git-dir"),
    ("git ls-remote --upload-pack='touch M' /etc", "--upload-pack"),
    ("git rebase -x 'touch M' HEAD~1", "rebase"),
    ("git grep -O'touch M' x", "grep"),
    ("git submodule foreach 'touch M'", "submodule"),
    ("git bisect run touch M", "bisect"),
    ("git config --edit", "--edit"),
    ("awk 'BEGIN{system(\"touch M\")}'", "awk"),
    ("awk '{print $1}' /etc/passwd", "awk"),
    ("gawk -f prog.awk x", "gawk"),
    ("sed -n '1e touch M' FILE", "sed e"),
    ("sed '$!d;e touch M' FILE", "sed e"),
    ("sed -n 's/x/touch M/e' FILE", "s///e"),
    ("sed -f script.sed FILE", "script file"),
    ("sed --expression='1e id' FILE", "sed e"),
    ("sed -ne '1e id' FILE", "sed e"),
    ("sed '1{e id\n}' FILE", "sed e"),
    ("sed 'b x;e id' FILE", "sed e"),
    ("sed --wibble 1p FILE", "not understood"),
    ("tar cf x --checkpoint=1 --checkpoint-action=exec='touch M' .", "checkpoint-action"),
    ("tar xf x --to-command='touch M'", "--to-command"),
    ("tar cf x -I 'sh -c id' .", "-I"),
    ("tar --use-compress-prog=sh -cf x .", "--use-compress-prog"),
    ("tar cf x -F ./next .", "-F"),
    ("tar tf host:/x.tar", "remote"),
    ("sort --compress-program=sh FILE", "--compress-program"),
    ("sort --compress-p=sh FILE", "--compress-p"),
    ("find . -exec id \\;", "-exec"),
    ("find . -execdir id \\;", "-execdir"),
    ("find . -ok id \\;", "-ok"),
    ("less /etc/hostname", "less"),
    ("more /etc/hostname", "more"),
    ("man ls", "man"),
    ("vim -es -c '!id'", "vim"),
    ("ed FILE", "ed"),
    ("perl -e 1", "perl"),
    ("python3 -c 1", "python3"),
    ("python3.11 script.py", "python3.11"),
    ("node -e 1", "node"),
    ("ruby -e 1", "ruby"),
    ("make all", "make"),
    ("env -S 'touch M'", ""),
    ("rsync -e 'sh -c id' a:b c", "-e"),
    ("rsync --rsync-path='id' a:b c", "--rsync-path"),
    ("ssh -o ProxyCommand='touch M' x", "ProxyCommand"),
    ("ssh -oLocalCommand=id -oPermitLocalCommand=yes x", "LocalCommand"),
    ("ssh -F ./cfg x", "-F"),
    ("scp -S ./prog a b:c", "-S"),
    ("sftp -b batch host", "-b"),
    ("zip x.zip f -T -TT 'touch M #'", "zip -TT"),
    ("zip x.zip f -T --unzip-command='touch M'", "zip -TT"),
    ("split --filter='touch M' FILE", "--filter"),
    ("wget --use-askpass=./x http://h/", "--use-askpass"),
    ("curl -K cfg http://h/", "-K"),
    ("openssl req -engine ./e.so", "-engine"),
    ("apt-get install x", "install"),
    ("apt -o APT::Update::Pre-Invoke::=id update", "-o"),
    ("pip install x", "install"),
    ("npm run build", "run"),
    ("crontab FILE", "crontab"),
    ("busybox awk 'BEGIN{}'", "awk"),
    ("sudo awk 'BEGIN{}'", "awk"),
    ("nice -n 5 sed '1e id' FILE", "sed e"),
    ("ksh93 -c 'touch M'", "ksh93"),
    ("tcsh -c 'touch M'", "tcsh"),
    ("docker run --rm x", "run"),
    ("kubectl -n prod exec pod -- id", "exec"),
    ("rpm --eval '%(touch M)'", "--eval"),
    ("go run .", "run"),
    ("sudo -e /etc/hosts", "sudo -e"),
    ("pager FILE", "pager"),
    ("java -jar x.jar", "java"),
    ("ssh-agent sh -c 'touch M'", ""),
    ("proxychains4 touch M", ""),
]

# (command, what its reason names): files written or acts beyond looking.
WRITES = [
    ("find . -fprint /tmp/x", "-fprint"),
    ("find . -fprint0 /tmp/x", "-fprint0"),
    ("find . -fprintf /tmp/x %p", "-fprintf"),
    ("find . -fls /tmp/x", "-fls"),
    ("find . -name '*.tmp' -delete", "-delete"),
    ("sort -o /tmp/x FILE", "-o"),
    ("sort --output=/tmp/x FILE", "--output"),
    ("sort -rno /tmp/x FILE", "-rno"),
    ("sort --o=/tmp/x FILE", "--o"),
    ("sed -i s/a/b/ FILE", "-i"),
    ("sed --in-place s/a/b/ FILE", "--in-place"),
    ("sed -n 'w /tmp/x' FILE", "w"),
    ("sed 's/a/b/w /tmp/x' FILE", "s///w"),
    ("tar cf x.tar .", "cf"),
    ("tar -xzf x.tgz", "-xzf"),
    ("tar --extract -f x.tar", "--extract"),
    ("git log --output=/tmp/x", "--output"),
    ("git format-patch -o /tmp/p HEAD~1", "-o"),
    ("git config alias.x '!id'", "git config"),
    ("git config --add core.pager x", "git config"),
    ("curl -o /tmp/x http://h/", "-o"),
    ("curl -sSO http://h/x", "-sSO"),
    ("wget http://h/x", "wget"),
    ("dd if=/dev/zero of=/tmp/x", "/tmp/x"),
    ("openssl rand -out /tmp/x 4", "-out"),
    ("systemctl status -H root@h cron", "-H"),
    ("journalctl --rotate", "--rotate"),
    ("journalctl --vacuum-size=1M", "--vacuum-size"),
    ("git log --ext-diff", "--ext-diff"),
]

# Reading forms of the same programs: their allow rules admit them.
READS = [
    "sed -n 1p FILE",
    "sed -n '/start/,/end/p' FILE",
    "sed 's/a/b/g; s|c|d|' FILE",
    "sed -e 's/a/b/' -e '$!N' -E FILE",
    "sed -n '$=' FILE",
    "sed 'y/abc/xyz/' FILE",
    "sed '1i header' FILE",
    "sed -n 'l 40' FILE",
    "sed 's/e/w/g' FILE",
    "sed --sandbox 's/x/y/' FILE",
    "find . -name x",
    "find /var/log -type f -mtime -1 -size +1M -print",
    "find . -maxdepth 2 -printf '%p\\n'",
    "tar tf x.tar",
    "tar -tvzf x.tgz",
    "tar --list -f x.tar",
    "git status",
    "git status --porcelain=v1 -uno",
    "git log --oneline -5",
    "git -c color.ui=never log -1",
    "git diff --stat",
    "git config --get user.name",
    "git config -l",
    "git show HEAD:README.md",
    "sort FILE",
    "sort -k2 -t, -n FILE",
    "echo a | xargs echo",
    "echo a | xargs -n1 echo",
    "echo a | xargs -I{} echo {}",
    "echo a | xargs cat",
    "curl -s http://h/health",
    "curl -fsS -H 'Accept: x' http://h/",
    "wget -qO- http://h/",
    "wget --spider http://h/",
    "dd if=/dev/sda bs=512 count=1 status=none",
    "openssl x509 -in cert.pem -noout -text",
    "python3 --version",
    "perl -v",
    "make --version",
    "apt list --installed",
    "pip list",
    "pip3 show x",
    "npm ls",
    "crontab -l",
    "ssh -o ConnectTimeout=5 host uptime",
    "rsync -avz src/ dst/",
    "zip -r x.zip dir",
    "systemctl status nginx",
    "journalctl -u nginx -n 50",
    "docker -H tcp://h ps",
    "kubectl -n prod get pods",
    "rpm -qa",
    "go version",
    "timeout 5 sed -n 1p FILE",
    "nice -n 5 git status",
]


@pytest.mark.parametrize(("command", "named"), CODE)
def test_code_a_program_runs_is_never_admitted_by_an_allow_rule(command: str, named: str) -> None:
    decision = decide("execute_command", {"command": command}, ALLOW_ALL)
    assert decision.verdict == "ask"
    assert named.lower() in decision.reason.lower(), decision.reason


@pytest.mark.parametrize(("command", "named"), CODE)
def test_code_a_program_runs_is_opaque_to_deny_and_ask_rules(command: str, named: str) -> None:
    assert verdict(command, DENY_TOUCH) in ("ask", "deny")
    assert verdict(command, ASK_TOUCH) == "ask"
    assert verdict(command, Policy(mode="bypass")) == "allow"  # no rule to check: the mode
    assert verdict(command, Policy(mode="strict")) == "deny"


@pytest.mark.parametrize(("command", "named"), WRITES)
def test_an_option_that_writes_is_never_admitted_by_an_allow_rule(command: str, named: str) -> None:
    decision = decide("execute_command", {"command": command}, ALLOW_ALL)
    assert decision.verdict == "ask"
    assert named.lower() in decision.reason.lower(), decision.reason


@pytest.mark.parametrize("command", READS)
def test_reading_forms_stay_allowed(command: str) -> None:
    decision = decide("execute_command", {"command": command}, ALLOW_ALL)
    assert decision.verdict == "allow", decision.reason
    assert verdict(command, DENY_TOUCH) == "allow"  # and nothing hidden from deny rules


@pytest.mark.parametrize(
    "command",
    [
        "sed -n '1e touch M' FILE",
        "git -c alias.x='!touch M' x",
        "tar cf x --checkpoint=1 --checkpoint-action=exec='touch M' .",
        "find . -exec touch M \\;",
        "zip x.zip f -T -TT 'touch M'",
        "ssh -o ProxyCommand='touch M' x",
        "split --filter='touch M' f",
        "git rebase --exec 'touch M' HEAD~2",
        "git ls-remote --upload-pack='touch M' /etc",
    ],
)
def test_shell_code_a_program_runs_in_view_meets_deny_rules(command: str) -> None:
    assert verdict(command, DENY_TOUCH) == "deny"
    assert ("touch", "M") in [c.layers[-1] for c in analyse(command).commands]


@pytest.mark.parametrize(
    "command",
    [
        "env touch M",
        "env -i A=1 touch M",
        "nice -n 5 touch M",
        "timeout 5 touch M",
        "timeout 5 nice touch M",
        "echo M | xargs touch",
        "echo M | xargs -I{} touch {}",
    ],
)
def test_a_rule_for_a_wrapper_admits_no_command_it_runs(command: str) -> None:
    assert verdict(command, ALLOW_ALL) == "ask"
    assert verdict(command, Policy(allow=(*ALLOW_ALL.allow, "execute_command(touch *)"))) in (
        "allow",
        "ask",  # `env -i A=1` assigns: a hazard of its own
    )


def test_an_exact_rule_admits_one_script_and_nothing_else() -> None:
    script = "awk '{print $1}' /etc/passwd"
    policy = Policy(allow=(f"execute_command({script})",))
    assert verdict(script, policy) == "allow"
    assert verdict("awk '{print $1}' /etc/shadow", policy) == "ask"
    assert verdict("awk 'BEGIN{system(\"id\")}' /etc/passwd", policy) == "ask"


def test_the_table_covers_the_programs_that_run_code() -> None:
    named = (
        "xargs git awk gawk mawk nawk sed tar sort find less more man vim vi nvim ed ex emacs"
        " nano perl python ruby node php lua tclsh rsync ssh scp sftp zip make gdb crontab at"
        " dpkg apt apt-get pip npm mysql psql sqlite3 openssl curl wget dd split"
    )
    assert [p for p in named.split() if p not in PROGRAMS and p != "xargs"] == []
    with pytest.raises(TypeError):
        PROGRAMS["cat"] = PROGRAMS["awk"]  # type: ignore[index]


def test_a_program_outside_the_table_does_nothing_beyond_its_work() -> None:
    use = program_use("cat", ("/etc/hostname",))
    assert (use.code, use.scripts, use.writes) == ((), (), ())


@pytest.mark.parametrize("command", ["echo a | xargs", "echo a | xargs -0 -n1 echo"])
def test_xargs_with_a_plain_program_is_plain(command: str) -> None:
    assert analyse(command).runs_code == ()


DENY_PUSH = Policy(mode="bypass", deny=("execute_command(git push*)",))
ASK_PUSH = Policy(ask=("execute_command(git push*)",))
GIT_GLOBALS = (
    "--no-pager,-P,-p,--paginate,--bare,--namespace=x,--namespace x,--literal-pathspecs"
    ",--no-optional-locks,--attr-source=HEAD,--attr-source HEAD,--glob-pathspecs"
    ",--noglob-pathspecs,--icase-pathspecs,--no-replace-objects,--exec-path,--html-path"
    ",-c color.ui=never,--"
)


@pytest.mark.parametrize("option", GIT_GLOBALS.split(","))
def test_git_global_options_do_not_hide_the_subcommand_from_deny_and_ask_rules(
    option: str,
) -> None:
    command = f"git {option} push --force origin main"
    assert verdict(command, DENY_PUSH) == "deny"
    assert verdict(command, ASK_PUSH) == "ask"


def test_an_allow_rule_sees_git_as_written() -> None:
    policy = Policy(allow=("execute_command(git log*)",))
    assert verdict("git log -1", policy) == "allow"
    assert verdict("git --no-pager log -1", policy) == "ask"  # a rule must name the option
    assert verdict("git --no-pager log -1", DENY_PUSH) == "allow"


@pytest.mark.parametrize(
    "command",
    [
        "find . | xargs rm",
        "find . -print0 | xargs -0 rm -f",
        "echo a | xargs /bin/rm",
        "echo a | xargs nice rm",
        "echo a | xargs -n1 timeout 5 rm",
    ],
)
def test_a_command_xargs_runs_meets_deny_and_ask_rules(command: str) -> None:
    assert verdict(command, Policy(mode="bypass", deny=("execute_command(rm *)",))) == "deny"
    assert verdict(command, Policy(mode="bypass", ask=("execute_command(rm *)",))) == "ask"


OPTION_RUNS = ["rg --pre rm .", "rg --pre=rm --pre-glob '*' x .", "fd -x rm", "fd -X rm"]
OPTION_RUNS += [
    "fd --exec rm {}",
    "fd -e py --exec-batch rm",
    "bat --pager rm f",
    "batcat --pager=rm f",
]
LAUNCHED = ["uv run rm x", "uv --directory d run rm x", "uvx rm", "poetry run rm x"]
LAUNCHED += ["conda run -n e rm x", "mamba run rm x", "micromamba run rm x", "pdm run rm x"]
LAUNCHED += ["hatch run rm x", "pipenv run rm x", "npx rm", "pnpm dlx rm", "bunx rm"]
LAUNCHED += ["faketime 2020-01-01 rm x", "nix-shell --run rm", "nix run nixpkgs#hello"]
READ_UNDER = {"rg": "rg foo .", "fd": "fd -e py", "bat": "bat f", "uv": "uv pip list"}


@pytest.mark.parametrize("command", OPTION_RUNS + LAUNCHED)
def test_a_program_another_program_runs_is_never_admitted_nor_let_through(command: str) -> None:
    name = command.split()[0]
    allow = Policy(allow=(f"execute_command({name} *)",))
    assert verdict(command, allow) == "ask"
    assert verdict(command, Policy(mode="bypass", deny=("execute_command(rm *)",))) != "allow"


@pytest.mark.parametrize(("name", "command"), READ_UNDER.items())
def test_their_reading_forms_stay_allowed(name: str, command: str) -> None:
    assert verdict(command, Policy(allow=(f"execute_command({name} *)",))) == "allow"
    assert verdict(command, DENY_TOUCH) == "allow"
