"""The pure parts of bounded work and of the floor's mounts: what is set, said and hidden."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from cmdop_worker.machine.bounds import shell_prefix, shell_sets_limits
from cmdop_worker.machine.cgroups import (
    CallCgroup,
    CgroupTree,
    open_v2,
    parse_cgroup_mounts,
    parse_own_cgroups,
)
from cmdop_worker.machine.floor_mounts import floor_args, is_env_name
from cmdop_worker.machine.limits import (
    MIB,
    Limits,
    Means,
    Overrun,
    ToolIds,
    describe,
    overrun_note,
    rlimits_for,
)
from cmdop_worker.machine.policy import load_policy
from cmdop_worker.machine.sandbox import filesystem_args

V1 = "8:pids:/\n4:memory:/svc/a\n2:cpu,cpuacct:/\n0::/\n"
MOUNTS = (
    "cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0\n"
    "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
    "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
    "proc /proc proc rw 0 0\n"
)


def test_own_cgroups_and_mounts_are_parsed() -> None:
    own = parse_own_cgroups(V1)
    assert own["pids"] == "/" and own["memory"] == "/svc/a" and own["cpuacct"] == "/"
    assert own[""] == "/"
    mounts = parse_cgroup_mounts(MOUNTS)
    assert mounts["pids"] == "/sys/fs/cgroup/pids" and mounts[""] == "/sys/fs/cgroup/unified"
    assert "proc" not in mounts


@pytest.mark.parametrize(
    ("means", "expected"),
    [
        (Means(pids_cgroup=True, memory_cgroup=True), {resource.RLIMIT_FSIZE}),
        (Means(tool_uid=0), {resource.RLIMIT_FSIZE, resource.RLIMIT_DATA}),
        (
            Means(tool_uid=1000),
            {resource.RLIMIT_FSIZE, resource.RLIMIT_DATA, resource.RLIMIT_NPROC},
        ),
    ],
)
def test_rlimits_stand_in_where_no_cgroup_holds(means: Means, expected: set[int]) -> None:
    assert {which for which, _ in rlimits_for(Limits(), means)} == expected


def test_no_limit_sets_nothing() -> None:
    assert rlimits_for(Limits(0, 0, 0, 0), Means()) == ()


def test_the_start_line_says_what_is_not_held() -> None:
    line = describe(Limits(), Means(tool_uid=0), "")
    assert "processes 256 (NOT held" in line and "RLIMIT_DATA" in line
    assert "NOT held: this bwrap has no --size" in line
    held = describe(Limits(), Means(True, True, True), "cgroup v1 per call")
    assert "NOT" not in held and "processes 256 (cgroup v1 per call)" in held


def test_overrun_notes_name_the_limit() -> None:
    limits = Limits(64, 256, 8, 16)
    assert overrun_note(limits, 0, Overrun()) is None
    assert overrun_note(limits, 137, Overrun(oom_kills=1)) == "killed: memory limit 256 MiB reached"
    assert "process limit 64 reached (3 process" in str(overrun_note(limits, 0, Overrun(3, 0)))
    assert "file size limit 8 MiB" in str(overrun_note(limits, 128 + signal.SIGXFSZ, Overrun()))


def test_policy_limits_are_read_and_checked() -> None:
    policy = load_policy({"sandbox": {"limits": {"max_processes": 64, "tmp_size_mb": 0}}})
    assert policy.sandbox.limits == Limits(max_processes=64, tmp_size_mb=0)
    assert load_policy({}).sandbox.limits == Limits()
    with pytest.raises(ValueError, match="max_procs"):
        load_policy({"sandbox": {"limits": {"max_procs": 1}}})
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        load_policy({"sandbox": {"limits": {"max_memory_mb": -1}}})


def test_private_trees_get_their_size() -> None:
    args = filesystem_args([], [], "/", tmp_size=16 * MIB)
    at = args.index("/tmp")
    assert args[at - 3 : at] == ["--size", str(16 * MIB), "--tmpfs"]
    assert "--size" not in filesystem_args([], [], "/")


@pytest.mark.parametrize(
    ("name", "hidden"),
    [
        (".env", True),
        (".env.local", True),
        (".env.production", True),
        (".envrc", False),
        (".env.example", False),
        (".env.sample", False),
        ("env", False),
    ],
)
def test_env_names(name: str, hidden: bool) -> None:
    assert is_env_name(name) is hidden


def test_floor_mounts_hide_what_exists_and_is_shown(tmp_path: Path) -> None:
    home, work, grant = tmp_path / "home", tmp_path / "work", tmp_path / "grant"
    for directory in (home / ".ssh", work / ".env.d", grant / ".git" / "hooks"):
        directory.mkdir(parents=True)
    (work / ".env").write_text("x")
    (work / ".env.example").write_text("x")
    (work / "sub").mkdir()
    (work / "sub" / ".env").write_text("deeper: the gate's text rule only")
    (grant / ".git" / "config").write_text("x")
    visible = [str(tmp_path)]
    args = floor_args(str(work), [str(grant)], visible, str(home), [], "/blank")
    assert ["--perms", "0000", "--tmpfs", f"{home}/.ssh"] == args[:4]
    assert ["--ro-bind", "/blank", f"{work}/.env"] == _after(args, f"{work}/.env")
    assert "--tmpfs" in _around(args, f"{work}/.env.d")
    assert ["--ro-bind", f"{grant}/.git/config", f"{grant}/.git/config"] == _after(
        args, f"{grant}/.git/config"
    )
    assert f"{work}/.env.example" not in args and f"{work}/sub/.env" not in args


def test_nothing_is_mounted_where_a_private_tmp_hides_it(tmp_path: Path) -> None:
    work = Path("/tmp") / tmp_path.name  # under the sandbox's private /tmp
    work.mkdir(exist_ok=True)
    try:
        (work / ".env").write_text("x")
        assert floor_args("/", [], [], None, [], "/blank") == floor_args(
            "/", [], [], None, [str(work / ".env")], "/blank"
        )
    finally:
        (work / ".env").unlink()
        work.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="hands a directory to another group")
def test_a_tool_user_s_own_group_reaches_what_must_be_hidden() -> None:
    # Under /tmp itself: a pytest directory is the worker's alone (0700).
    work = Path(tempfile.mkdtemp(prefix="cmdop-floor-", dir="/tmp"))
    try:
        os.chown(work, 0, 54321)  # a group the worker is not in, the tool user is
        work.chmod(0o2770)
        (work / ".env").write_text("x")
        env = str(work / ".env")
        member = ToolIds(4242, 4242, (4242, 54321))
        outsider = ToolIds(4242, 4242, (4242,))
        args = floor_args(str(work), [], [str(work)], None, [], "/blank", member)
        assert ["--ro-bind", "/blank", env] == _after(args, env)
        # One who cannot reach the directory could not read it either: nothing to hide.
        assert env not in floor_args(str(work), [], [str(work)], None, [], "/blank", outsider)
    finally:
        shutil.rmtree(work)


def _after(args: list[str], target: str) -> list[str]:
    at = len(args) - 1 - args[::-1].index(target)
    return args[at - 2 : at + 1]


def _around(args: list[str], target: str) -> list[str]:
    at = len(args) - 1 - args[::-1].index(target)
    return args[at - 3 : at + 1]


def test_a_v2_tree_delegates_and_writes_each_call_s_limits(tmp_path: Path) -> None:
    """cgroup v2's files, on a plain directory standing in for the cgroup filesystem
    (this host's controllers are on v1): which files are written, and read back."""
    mine = tmp_path / "svc"
    mine.mkdir()
    (mine / "cgroup.controllers").write_text("cpu io memory pids\n")
    tree = open_v2({"": "/svc"}, {"": str(tmp_path)}, 4242)
    assert isinstance(tree, CgroupTree) and tree.version == 2
    calls = mine / "cmdop-calls-4242"
    assert dict(tree.bases) == {"pids": str(calls), "memory": str(calls)}
    assert (mine / "cgroup.subtree_control").read_text() == "+pids +memory"
    assert (calls / "cgroup.subtree_control").read_text() == "+pids +memory"
    call = CallCgroup(tree, Limits(64, 256, 8, 16))
    (directory,) = set(call.dirs.values())
    here = Path(directory)
    assert (here / "pids.max").read_text() == "64"
    assert (here / "memory.max").read_text() == str(256 * MIB)
    assert (here / "memory.swap.max").read_text() == "0"
    assert call.procs_files == (str(here / "cgroup.procs"),)  # v1: `tasks`
    (here / "pids.events").write_text("max 3\n")
    (here / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    assert call.overrun() == Overrun(forks_refused=3, oom_kills=1)
    call.remove()  # a plain directory with files: not removable, and no error


def test_v2_without_the_controllers_says_so(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    assert "offers no pids/memory" in str(open_v2({"": "/"}, {"": str(tmp_path)}, 1))
    assert open_v2({}, {}, 1) == "no cgroup v2"


def test_the_shell_takes_on_file_and_data_limits_and_leaves_the_rest_to_the_hook() -> None:
    fsize, data = resource.RLIMIT_FSIZE, resource.RLIMIT_DATA
    prefix = shell_prefix(["/cg/a/cgroup.procs"], [(fsize, 8 * MIB), (data, 4 * MIB)])
    assert prefix is not None
    assert prefix[:2] == ("/bin/sh", "-c") and prefix[4:] == (
        "1",
        "/cg/a/cgroup.procs",
        str(8 * MIB // 512),
        str(4 * MIB // 1024),
    )
    assert shell_prefix([], [])[-2:] == ("-", "-")  # type: ignore[index]
    assert shell_prefix([], [(resource.RLIMIT_NPROC, 10)]) is None
    assert shell_sets_limits()  # this host's /bin/sh sets them as asked
