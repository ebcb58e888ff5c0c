"""One machine worker's standing parts: its name, tools, policy, audit log, sandbox and
where it parks the calls it asks a person about.

Built once per process (`lifecycle.machine_side`) and handed to every tool call. The
sandbox is resolved here: the bwrap binary is found and probed when the worker
starts, and a worker whose sandbox cannot start refuses to start
(`SandboxUnavailable`) unless the operator set `CMDOP_SANDBOX=off`. `jail_for` gives
each call its confinement, by how the gate let it through: a call allowed by a rule
or by the mode may write only the policy's `[sandbox] writable` paths, a call a person
approved its `approved_writable` ones. Its network is the policy's, through the
worker's egress proxy (`egress`), started once here when the policy gives tools any.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from cmdop_worker.config import config_error, masked_url
from cmdop_worker.machine.audit import AuditLog
from cmdop_worker.machine.bounds import Bounds, open_bounds
from cmdop_worker.machine.egress import EgressProxy, proxy_sockets
from cmdop_worker.machine.floor_mounts import make_blank
from cmdop_worker.machine.gitenv import GIT_SAFE_ENV
from cmdop_worker.machine.netpolicy import fleet_sockets
from cmdop_worker.machine.permissions import Policy, load_policy
from cmdop_worker.machine.progpath import searched_path
from cmdop_worker.machine.registry import ToolRegistry
from cmdop_worker.machine.sandbox import (
    DEFAULT_PATH,
    Confinement,
    find_bwrap,
    probe,
    tool_env,
)
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.approvals import Approvals

log = logging.getLogger(__name__)
_SECRET_VARIABLES = ("ANTHROPIC_API_KEY", "CMDOP_ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")
_egress_lock = threading.Lock()


class SandboxUnavailable(RuntimeError):
    """bubblewrap cannot start on this machine, and the operator did not turn it off."""


@dataclass
class MachineSide:
    rt: Runtime
    machine: str
    registry: ToolRegistry
    cwd: str = field(default_factory=os.getcwd)  # where tools run: the worker's own
    _egress: EgressProxy | None = field(default=None, init=False, repr=False)

    @cached_property
    def policy(self) -> Policy:
        """The policy file's rules; the mode from `CMDOP_PERMISSION_MODE` when it is set
        (one shared file, a mode per machine), else the file's, else "default"."""
        settings = self.rt.settings
        data = settings.load_policy()  # ConfigFileError: unreadable, or not TOML
        mode = settings.permission_mode
        keep_mode = "permission_mode" not in settings.model_fields_set and "mode" in data
        try:
            return load_policy(data, mode=None if keep_mode else mode)
        except ValueError as exc:
            assert settings.policy_file is not None  # no file: the default policy is valid
            raise config_error(settings.policy_file, exc.__cause__ or exc) from None

    @cached_property
    def approvals(self) -> Approvals:
        """Where this machine parks the calls it asks a person about."""
        rt = self.rt
        return Approvals(rt.redis, rt.keys, rt.events, ttl_s=rt.settings.run_ttl_s)

    @cached_property
    def audit(self) -> AuditLog | None:
        path = self.rt.settings.audit_log
        return AuditLog(path, clock_ms=now_ms) if path is not None else None

    @cached_property
    def bwrap(self) -> str | None:
        """The bwrap binary tools run under; None when the operator turned it off."""
        settings = self.rt.settings
        if settings.sandbox == "off":
            log.warning(
                "CMDOP_SANDBOX=off: tool processes run unsandboxed: they see the worker's "
                "processes, reach whatever this host reaches (the fleet's Redis included: "
                "[sandbox] network is not enforced) and may write wherever %s may",
                settings.tool_user or "the worker's user",
            )
            return None
        binary = settings.bwrap or find_bwrap()
        problem = probe(binary, self.cwd)
        if problem is not None:
            raise SandboxUnavailable(
                f"{problem}. Tools cannot be sandboxed here; set CMDOP_SANDBOX=off to run "
                "them unsandboxed (and CMDOP_TOOL_USER to run them as another user)"
            )
        return binary

    @property
    def egress(self) -> EgressProxy | None:
        """The proxy tools reach the network through, started on first use; None when
        the policy gives them none, or they run unsandboxed (nothing to hold them)."""
        network = self.policy.sandbox.network
        if not network or self.bwrap is None:
            return None
        with _egress_lock:
            if self._egress is None:
                settings = self.rt.settings
                fleet = [settings.redis_url, settings.effective_broker_url]
                fleet += [settings.gateway_url] if settings.gateway_url else []
                self._egress = EgressProxy(network, fleet).start()
            return self._egress

    @property
    def sandbox_label(self) -> str:
        """What presence and `cmdop-worker machines` show: "bwrap", or "off"; and the
        tools registered with `sandbox=False`, which run in the worker regardless."""
        label = "bwrap" if self.bwrap is not None else "off"
        user = self.rt.settings.tool_user
        label = f"{label} (as {user})" if user else label
        unboxed = self.registry.unsandboxed()
        return f"{label}; unsandboxed: {', '.join(unboxed)}" if unboxed else label

    @cached_property
    def bounds(self) -> Bounds | None:
        """Each sandboxed call's limits and the means that hold them (found and logged
        once, at start); None unsandboxed."""
        if self.bwrap is None:
            return None
        return open_bounds(self.policy.sandbox.limits, self.bwrap, self.rt.settings.tool_user)

    @cached_property
    def blank(self) -> str:
        """What the floor's files look like inside the sandbox (`floor_mounts`)."""
        return make_blank()

    @cached_property
    def own_files(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What no tool reads or rewrites (this worker's audit log: past calls' input),
        and what no tool rewrites (its policy)."""
        settings = self.rt.settings
        hidden, kept = settings.audit_log, settings.policy_file
        return _real(hidden), _real(kept)

    @cached_property
    def fleet_sockets(self) -> tuple[str, ...]:
        """The unix sockets the fleet's URLs name (a Redis on one), as real paths: no
        tool may reach them, whatever its network (`floor_mounts`). Each call also
        hides the other egress proxies on this host (`egress.proxy_sockets`)."""
        settings = self.rt.settings
        named = fleet_sockets([settings.redis_url, settings.effective_broker_url])
        return tuple(dict.fromkeys(os.path.realpath(p) for p in named))

    @cached_property
    def tool_env(self) -> dict[str, str]:
        return tool_env(os.environ, self.rt.settings.tool_env)

    def jail_for(self, let_through: Literal["allow", "approved"]) -> Confinement:
        """The confinement of a call the gate allowed, or a person approved."""
        box = self.policy.sandbox
        egress = self.egress
        own_proxy = egress.socket_path if egress is not None else None
        env = self.tool_env
        if let_through == "allow":  # no program a repository's git config names (`gitenv`)
            env = {**env, **GIT_SAFE_ENV}
            # nor one a bare name finds where such a call may have written it (`progpath`)
            env["PATH"] = searched_path(env.get("PATH", DEFAULT_PATH), box.writable)
        return Confinement(
            bwrap=self.bwrap,
            writable=box.approved_writable if let_through == "approved" else box.writable,
            reachable=box.reachable,
            network=egress is not None,
            egress=own_proxy,
            env=env,
            user=self.rt.settings.tool_user,
            bounds=self.bounds,
            hidden=self.own_files[0],
            kept=self.own_files[1],
            blank=self.blank if self.bwrap is not None else "/dev/null",
            sockets=(*self.fleet_sockets, *proxy_sockets(own_proxy)),
        )


def _real(path: object) -> tuple[str, ...]:
    return (os.path.realpath(str(path)),) if path is not None else ()


def scrub_environment(environ: MutableMapping[str, str]) -> None:
    """Keep this process's secrets out of what in-process tools can read (a user's
    Python tool, a file tool's error text): API keys are dropped and passwords in URLs
    (the Redis URL) masked. Called once the process has read its settings. Tool
    processes never inherit this environment: theirs is built (`sandbox.tool_env`)."""
    for name in _SECRET_VARIABLES:
        environ.pop(name, None)
    for name, value in list(environ.items()):
        masked = masked_url(value)
        if masked != value:
            environ[name] = masked
