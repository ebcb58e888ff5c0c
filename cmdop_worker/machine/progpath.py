"""Which programs named by a path the gate can know: pure, over the policy's grants.

A deny rule names a program; a program the sandbox could have written (`cp
/usr/bin/touch /tmp/zz && /tmp/zz …`, a script made by write_file and `chmod`, a
symlink to bash) is one no rule can know by its name. So a command word holding `/` is
known only when it is an absolute path, without `.` or `..` parts, under a system tree
the sandbox keeps read-only (`SYSTEM_TREES`), and outside every `writable` grant of the
policy and the sandbox's private trees (`/tmp`, `/run`, `/dev`, …). Anything else (a
relative path, `/tmp/x`, a path in a writable project) is `unknown_program`: never
admitted by an allow rule's glob, and asked about where deny or ask rules would have
to see it. A bare name is looked up through PATH, which a command can only change
through an assignment, `export` or `hash -p` (hazards of their own), and which for a
call let through by a rule or the mode holds no directory such a call may write
(`searched_path`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Sequence

__all__ = [
    "PRIVATE_TREES",
    "SYSTEM_TREES",
    "searched_path",
    "unknown_program",
    "unknown_programs",
]

SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
# Writable in every sandbox (its own tmpfs) or not files at all.
PRIVATE_TREES = ("/tmp", "/run", "/dev", "/proc", "/sys", "/var/tmp")


def _under(path: str, trees: Iterable[str]) -> bool:
    for tree in trees:
        tree = posixpath.normpath(tree) if tree else "/"
        if tree == "/" or path == tree or path.startswith(tree + "/"):
            return True
    return False


def unknown_program(word: str, writable: Sequence[str]) -> bool:
    """Whether the command word `word` names a program by a path the gate cannot know."""
    if "/" not in word:
        return False
    parts = word.split("/")
    if not word.startswith("/") or "." in parts or ".." in parts:
        return True
    path = posixpath.normpath(word)
    if not _under(path, SYSTEM_TREES):
        return True
    return _under(path, (*PRIVATE_TREES, *writable))


def unknown_programs(words: Iterable[str], writable: Sequence[str]) -> tuple[str, ...]:
    """The command words among `words` that name unknown programs, each once."""
    return tuple(dict.fromkeys(w for w in words if unknown_program(w, writable)))


def searched_path(value: str, writable: Sequence[str]) -> str:
    """A PATH with no directory a sandboxed call may write: relative and empty entries
    (the working directory), the private trees and the `writable` grants are dropped, so
    a bare name never finds a program such a call planted. A grant holding a whole
    system tree (`/`) is not applied: it would leave nothing to run, and every path is
    then unknown to the gate anyway."""
    grants = [w for w in writable if not any(_under(tree, (w,)) for tree in SYSTEM_TREES)]
    unsafe = (*PRIVATE_TREES, *grants)
    entries = (e for e in value.split(":") if e.startswith("/"))
    kept = [e for e in entries if not _under(posixpath.normpath(e), unsafe)]
    return ":".join(dict.fromkeys(kept)) or "/usr/bin:/bin"
