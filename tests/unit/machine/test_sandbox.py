"""The parts behind the sandbox: canonical paths, the tool environment, bwrap's argv.

The attacks that prove them run through real workers in
`tests/integration/test_sandbox_attacks.py` and `test_file_paths.py`; these pin the
pieces down, one rule a row.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cmdop_worker.machine.paths import PathRefused, canonical, canonical_input, glob_root
from cmdop_worker.machine.process import run_command
from cmdop_worker.machine.sandbox import (
    Confinement,
    confined_argv,
    covers,
    find_bwrap,
    probe,
    tool_env,
)
from tests.procs import sleeper, sleeping_pids, wait_for

BWRAP = find_bwrap()
needs_bwrap = pytest.mark.skipif(BWRAP is None, reason="no bwrap binary")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    (tmp_path / "a" / "up").symlink_to(tmp_path)
    (tmp_path / "a" / "etc").symlink_to("/etc")
    (tmp_path / "a" / "link").symlink_to(tmp_path / "file")
    return tmp_path


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("a/../file", "{t}/file"),
        ("a//b/..//../file", "{t}/file"),
        ("{t}/a/b/../../file", "{t}/file"),
        ("a/up/file", "{t}/file"),
        ("a/up/a/up/a/b", "{t}/a/b"),
        ("a/link", "{t}/file"),
        ("a/etc/hostname", "/etc/hostname"),
        ("a/missing/../file", "{t}/a/file"),
        ("a/new-file", "{t}/a/new-file"),
    ],
)
def test_canonical_resolves_what_will_be_touched(tree: Path, path: str, expected: str) -> None:
    resolved = os.path.realpath(tree)
    assert canonical(path.format(t=tree), str(tree)) == expected.format(t=resolved)


def test_canonical_expands_the_home_directory(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tree))
    assert canonical("~/file", "/") == os.path.realpath(tree / "file")


def test_write_file_refuses_a_final_symlink_and_resolves_the_parent(tree: Path) -> None:
    with pytest.raises(PathRefused, match="symlink"):
        canonical_input("write_file", {"path": "a/link", "content": ""}, str(tree))
    out = canonical_input("write_file", {"path": "a/up/new", "content": ""}, str(tree))
    assert out["path"] == os.path.realpath(tree) + "/new"


@pytest.mark.parametrize(
    ("pattern", "base", "root", "rest"),
    [
        ("*.py", ".", "{t}", "*.py"),
        ("a/b/*.py", ".", "{t}/a/b", "*.py"),
        ("a/**/x", ".", "{t}/a", "**/x"),
        ("/etc/*.conf", ".", "/etc", "*.conf"),
        ("a/up/a/*", ".", "{t}/a", "*"),
        ("b", "a", "{t}/a", "b"),
    ],
)
def test_glob_root_is_the_tree_searched(
    tree: Path, pattern: str, base: str, root: str, rest: str
) -> None:
    resolved = os.path.realpath(tree)
    assert glob_root(pattern, base, str(tree)) == (root.format(t=resolved), rest)


@pytest.mark.parametrize("pattern", ["../*", "a/../../*", "**/../x"])
def test_glob_patterns_that_climb_are_refused(tree: Path, pattern: str) -> None:
    with pytest.raises(PathRefused, match=r"\.\."):
        canonical_input("glob", {"pattern": pattern}, str(tree))


def test_tool_env_is_an_allowlist_plus_named_variables() -> None:
    worker = {
        "PATH": "/bin",
        "HOME": "/root",
        "LC_ALL": "C",
        "ANTHROPIC_API_KEY": "sk-x",
        "CMDOP_REDIS_URL": "redis://:pw@h/0",
        "APP_TOKEN": "t",
        "DEPLOY_ENV": "prod",
    }
    assert tool_env(worker, ["DEPLOY_ENV"]) == {
        "PATH": "/bin",
        "HOME": "/root",
        "LC_ALL": "C",
        "DEPLOY_ENV": "prod",
    }
    assert "PATH" in tool_env({})


@pytest.mark.parametrize(
    ("granted", "path", "inside"),
    [("/", "/etc", True), ("/srv", "/srv/a", True), ("/srv", "/srv2", False), ("/a/", "/a", True)],
)
def test_covers(granted: str, path: str, inside: bool) -> None:
    assert covers(granted, path) is inside


def test_argv_is_read_only_with_private_tmp_and_grants_bound(tmp_path: Path) -> None:
    jail = Confinement(bwrap="bwrap", writable=(str(tmp_path),), network=False, env={"A": "1"})
    argv = confined_argv(["sh", "-c", "x"], jail, "/")
    joined = " ".join(argv)
    assert argv[-4:] == ["--", "sh", "-c", "x"]
    for part in ("--ro-bind / /", "--unshare-pid", "--die-with-parent", "--cap-drop ALL"):
        assert part in joined
    assert "--unshare-net" in argv and "--clearenv" in argv
    assert f"--bind-try {tmp_path} {tmp_path}" in joined
    assert "--setenv A 1" in joined
    unsandboxed = confined_argv(["sh"], Confinement(bwrap=None), "/")
    assert unsandboxed == ["sh"]


@needs_bwrap
def test_probe_says_yes_here_and_why_not_for_a_broken_binary(tmp_path: Path) -> None:
    assert probe(BWRAP, str(tmp_path)) is None
    assert "no bwrap binary" in str(probe(None, "/"))
    assert probe("/bin/false", "/") is not None


@needs_bwrap
def test_a_sandboxed_command_sees_only_its_own_processes_and_env(tmp_path: Path) -> None:
    jail = Confinement(bwrap=BWRAP, env=tool_env({"PATH": os.environ["PATH"]}))
    result = run_command(
        "ls /proc | grep -c '^[0-9]'; cat /proc/1/environ | tr '\\0' ' '",
        timeout_s=10,
        cwd=str(tmp_path),
        jail=jail,
    )
    count, env = result.stdout.splitlines()
    assert int(count) <= 6  # bwrap, the shell, ls, grep: nothing of this process's
    assert env.split() == [f"PATH={os.environ['PATH']}"]


@needs_bwrap
def test_a_sandboxed_command_writes_only_where_granted(tmp_path: Path) -> None:
    granted, other = tmp_path / "granted", Path(f"/var/tmp/cmdop-unit-{os.getpid()}")
    granted.mkdir()
    jail = Confinement(bwrap=BWRAP, writable=(str(granted),), env=tool_env(os.environ))
    script = f"touch {granted}/yes; touch {other}; touch /tmp/private; echo done"
    result = run_command(script, timeout_s=10, cwd=str(tmp_path), jail=jail)
    assert "done" in result.stdout and "Read-only file system" in result.stderr
    assert (granted / "yes").exists() and not other.exists()


@needs_bwrap
def test_cancel_kills_the_whole_sandbox_even_a_process_that_left_the_group(
    tmp_path: Path,
) -> None:
    jail = Confinement(bwrap=BWRAP, env=tool_env(os.environ))
    cancel = threading.Event()
    sleeps = [sleeper(60) for _ in range(3)]
    running: list[bool] = []

    def cancel_once_running() -> None:
        wait_for(lambda: all(sleeping_pids(s) for s in sleeps), 10, "the sleeps to start")
        running.append(True)
        cancel.set()

    threading.Thread(target=cancel_once_running, daemon=True).start()
    command = f"setsid {sleeps[0]} & nohup {sleeps[1]} & {sleeps[2]}"
    result = run_command(command, timeout_s=30, cancelled=cancel, cwd=str(tmp_path), jail=jail)
    assert result.cancelled and running == [True]
    wait_for(lambda: not any(sleeping_pids(s) for s in sleeps), 5, "every sandboxed sleep gone")


def test_a_link_swapped_in_after_the_check_fails_the_write(tmp_path: Path) -> None:
    from cmdop_worker.machine.fileops import write_atomic

    app, outside = tmp_path / "app", tmp_path / "outside"
    (app / "d").mkdir(parents=True)
    outside.mkdir()
    checked = canonical_input("write_file", {"path": str(app / "d" / "f"), "content": ""}, "/")
    (app / "d").rmdir()
    (app / "d").symlink_to(outside)  # the swap, after the gate saw a real directory
    with pytest.raises(PathRefused, match="symlink"):
        write_atomic(Path(checked["path"]), b"owned")
    assert list(outside.iterdir()) == []


def test_a_link_swapped_in_after_the_check_fails_the_read(tmp_path: Path) -> None:
    from cmdop_worker.machine.paths import open_file_beneath

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("fine")
    (tmp_path / "secret").write_text("secret")
    checked = canonical(str(tmp_path / "d" / "f"), "/")
    os.unlink(checked)
    os.symlink(tmp_path / "secret", checked)
    with pytest.raises(OSError):
        open_file_beneath(checked)


def test_write_atomic_drops_set_id_bits(tmp_path: Path) -> None:
    from cmdop_worker.machine.fileops import write_atomic

    target = tmp_path / "tool"
    target.write_text("old")
    target.chmod(0o4755)
    write_atomic(target, b"new")
    assert target.stat().st_mode & 0o7777 == 0o755


def test_read_file_refuses_a_fifo_without_blocking_and_leaks_no_descriptor(tmp_path: Path) -> None:
    from cmdop_worker.machine.paths import open_file_beneath

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    before = len(os.listdir("/proc/self/fd"))
    for path in (fifo, tmp_path):
        with pytest.raises(OSError, match="not a regular file"):
            open_file_beneath(str(path))
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("path", ["/proc/self/environ", "/proc/1/mem", "/proc/12/task/12/environ"])
def test_file_tools_may_not_read_the_worker_s_process_files(path: str) -> None:
    from cmdop_worker.machine.permissions import Policy, decide

    assert decide("read_file", {"path": path}, Policy(mode="bypass")).source == "floor"
    assert decide("read_file", {"path": "/proc/meminfo"}, Policy(mode="bypass")).verdict == "allow"
