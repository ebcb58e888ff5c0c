"""Git settings that keep a repository's own config from running programs, for calls
let through by a rule or the mode.

An allow rule for `git status*` or `git log*` reads as looking around, but git runs
programs its repository's config names: `core.fsmonitor` on `git status`,
`gpg.program` on `git log` when `log.showSignature` is set, `diff.external` on `git
diff`, a pager, hooks, ssh and credential helpers. A sandboxed call cannot write
`.git/config` (the floor), but a repository that arrived hostile (unpacked from an
archive, cloned by a person) already holds such settings. Git reads `GIT_CONFIG_COUNT`,
`GIT_CONFIG_KEY_<n>` and `GIT_CONFIG_VALUE_<n>` at command-line precedence, above every
config file, so `GIT_SAFE_ENV` in such a call's environment overrides each key by
which git runs a program on a reading command. An empty value disables a key where
git reads it as unset (helpers, ssh command, proxy); where an empty value breaks the
command (`diff.external`), the value is a plain `diff -u`. A call a person approved
gets the repository's config as it is.

Not covered, as their keys are named by the repository: diff drivers (`textconv`)
and filters (`clean`, `smudge`, `process`) a `.gitattributes` names, and
`remote.<name>.uploadpack`. Pure data.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["GIT_SAFE_CONFIG", "GIT_SAFE_ENV"]

# git runs diff.external as `sh -c 'VALUE "$@"'` with seven arguments; $2 and $5 are
# the old and new files. Exit 1 from diff means "they differ", not a failure.
_PLAIN_DIFF = 'f() { diff -u -- "$2" "$5"; test $? -le 1; }; f'
_PAGED = "log show diff status branch tag grep blame shortlog reflog stash config"
GIT_SAFE_CONFIG: tuple[tuple[str, str], ...] = (
    ("core.fsmonitor", "false"),
    ("core.hooksPath", "/dev/null"),
    ("core.pager", "cat"),
    ("core.editor", "false"),
    ("sequence.editor", "false"),
    ("core.sshCommand", ""),
    ("core.askPass", ""),
    ("core.gitProxy", ""),
    ("core.alternateRefsCommand", ""),
    ("credential.helper", ""),  # an empty value resets the list of helpers
    ("gpg.program", "false"),
    ("gpg.openpgp.program", "false"),
    ("gpg.ssh.program", "false"),
    ("gpg.x509.program", "false"),
    ("gpg.ssh.defaultKeyCommand", ""),
    ("log.showSignature", "false"),
    ("diff.external", _PLAIN_DIFF),
    ("protocol.ext.allow", "never"),
    ("gc.auto", "0"),
    ("maintenance.auto", "false"),
    *((f"pager.{command}", "false") for command in _PAGED.split()),
)


def _as_env(pairs: tuple[tuple[str, str], ...]) -> dict[str, str]:
    env = {"GIT_CONFIG_COUNT": str(len(pairs))}
    for i, (key, value) in enumerate(pairs):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    return env


GIT_SAFE_ENV: Mapping[str, str] = MappingProxyType(_as_env(GIT_SAFE_CONFIG))
