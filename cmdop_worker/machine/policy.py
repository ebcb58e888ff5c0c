"""A machine's permission policy, as loaded from its TOML file.

    mode = "default"            # default -> ask, strict -> deny, bypass -> allow
    [rules]
    allow = ["execute_command(git status*)", "read_file(/var/log/*)"]
    ask = ["execute_command(systemctl restart *)"]
    deny = ["execute_command(reboot*)"]
    [sandbox]
    network = "none"            # or "any" (but the fleet and this machine), or a list of
                                # hosts, CIDRs, host:port (`netpolicy`); true = "any"
    writable = []               # paths a command let through by a rule or the mode may write
    approved_writable = ["/"]   # paths a command a person approved may write
    reachable = []              # paths under the private /tmp and /run shown read-only
    [sandbox.limits]            # per call; 0 = no limit (`limits`)
    max_processes = 256         # processes and threads
    max_memory_mb = 1024
    max_file_size_mb = 1024     # any one file a call writes
    tmp_size_mb = 256           # its private /tmp, and its private /run

The rules are decided by `permissions.decide`; the `[sandbox]` table is what the
sandbox (`sandbox.Confinement`) enforces for each call, by how the call was let
through. Pure: the worker reads the file, `load_policy` checks and builds the value.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cmdop_worker.machine.limits import Limits
from cmdop_worker.machine.netpolicy import NO_NETWORK, NetworkPolicy, parse_network

_RULE = re.compile(r"^\s*([A-Za-z0-9_*?.\-\[\]]+)\s*(?:\((.*)\))?\s*$", re.DOTALL)

Mode = Literal["default", "strict", "bypass"]
MODE_VERDICT: Mapping[str, Literal["allow", "ask", "deny"]] = {
    "default": "ask",
    "strict": "deny",
    "bypass": "allow",
}


@dataclass(frozen=True)
class Rule:
    """One parsed `tool(argGlob)`; `arg_glob` None means any argument."""

    text: str
    tool_glob: str
    arg_glob: str | None

    def matches(self, tool: str, subject: str) -> bool:
        if not fnmatch.fnmatchcase(tool, self.tool_glob):
            return False
        return self.arg_glob is None or fnmatch.fnmatchcase(subject, self.arg_glob)

    @property
    def covers_whole_command(self) -> bool:
        """Bare or `*`: may allow any command line as a whole."""
        return self.arg_glob is None or self.arg_glob.strip() in ("*", "**")

    @property
    def is_path_rule(self) -> bool:
        return self.arg_glob is not None and self.arg_glob.lstrip().startswith(("/", "~"))


@lru_cache(maxsize=1024)
def parse_rule(text: str) -> Rule:
    """`execute_command(git status*)`, `read_file(/var/log/**)` or a bare `list_dir`."""
    match = _RULE.match(text)
    if match is None:
        raise ValueError(f"bad permission rule {text!r}: expected tool or tool(argGlob)")
    tool_glob, arg_glob = match.group(1), match.group(2)
    if arg_glob is not None and not arg_glob.strip():
        raise ValueError(f"bad permission rule {text!r}: empty argument glob")
    return Rule(text=text.strip(), tool_glob=tool_glob, arg_glob=arg_glob)


@dataclass(frozen=True)
class SandboxPolicy:
    """What tool processes may do once the gate let them through."""

    network: NetworkPolicy = NO_NETWORK
    writable: tuple[str, ...] = ()
    approved_writable: tuple[str, ...] = ("/",)
    reachable: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class Policy:
    mode: Mode = "default"
    allow: tuple[str, ...] = ()
    ask: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    sandbox: SandboxPolicy = field(default_factory=SandboxPolicy)

    def __post_init__(self) -> None:
        if self.mode not in MODE_VERDICT:
            raise ValueError(f"unknown permission mode {self.mode!r}")
        for text in (*self.allow, *self.ask, *self.deny):
            parse_rule(text)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Policy:
        """From TOML data: `{"mode": …, "rules": {"allow": [...], …}, "sandbox": {…}}`."""
        try:
            parsed = _PolicyFile.model_validate(dict(data))
        except ValidationError as exc:
            raise ValueError(f"invalid permission policy: {exc}") from exc
        rules, box = parsed.rules, parsed.sandbox
        return cls(
            mode=parsed.mode,
            allow=rules.allow,
            ask=rules.ask,
            deny=rules.deny,
            sandbox=SandboxPolicy(
                box.network,
                box.writable,
                box.approved_writable,
                box.reachable,
                Limits(**box.limits.model_dump()),
            ),
        )


class _Rules(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    allow: tuple[str, ...] = ()
    ask: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()


class _Limits(BaseModel):
    """Per call; 0: no limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_processes: int = Field(default=Limits.max_processes, ge=0)
    max_memory_mb: int = Field(default=Limits.max_memory_mb, ge=0)
    max_file_size_mb: int = Field(default=Limits.max_file_size_mb, ge=0)
    tmp_size_mb: int = Field(default=Limits.tmp_size_mb, ge=0)


class _Sandbox(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    network: Any = NO_NETWORK
    writable: tuple[str, ...] = ()
    approved_writable: tuple[str, ...] = ("/",)
    reachable: tuple[str, ...] = ()
    limits: _Limits = _Limits()

    @field_validator("network", mode="before")
    @classmethod
    def _network(cls, value: Any) -> NetworkPolicy:
        return value if isinstance(value, NetworkPolicy) else parse_network(value)


class _PolicyFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: Mode = "default"
    rules: _Rules = _Rules()
    sandbox: _Sandbox = _Sandbox()


def load_policy(data: Mapping[str, Any], *, mode: Mode | None = None) -> Policy:
    """The policy from loaded TOML data; `mode`, when given, overrides the file's."""
    policy = Policy.from_mapping(data)
    if mode is None:
        return policy
    return Policy(mode, policy.allow, policy.ask, policy.deny, policy.sandbox)


def tools_have_network(policy: Policy, *, sandboxed: bool = True) -> bool:
    """Whether a tool may open any connection beyond its own sandbox: the policy gives
    it network, or there is no sandbox (`CMDOP_SANDBOX=off`) to take it away."""
    return bool(policy.sandbox.network) or not sandboxed
