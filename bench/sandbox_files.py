"""The sandbox's cost per file-tool call: the sandboxed file server vs in-process.

Each file tool runs through `ToolRegistry.run` as the machine worker runs it, once
with the call's bubblewrap confinement (served by the pooled file server, `filejail`)
and once unsandboxed (`CMDOP_SANDBOX=off`: in the worker's own process), in
interleaved rounds with the order alternated. The pool is warmed first: the figure
is the steady per-call cost, a pipe round trip. Also measured: how long a ui cancel
of a busy file call takes to answer (the server is killed), and the first call after
it (a fresh server starts).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from random import Random
from typing import Any

from bench.common import Result, pct
from cmdop_worker.machine.registry import ToolContext, ToolRegistry, register_builtins
from cmdop_worker.machine.sandbox import Confinement

TARGET_EXTRA_MS = 5.0


def calls(work: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "read_file": ("read_file", {"path": str(work / "src" / "f0.py")}),
        "write_file": ("write_file", {"path": str(work / "out.txt"), "content": "x" * 4096}),
        "list_dir": ("list_dir", {"path": str(work / "src")}),
        "grep": ("grep", {"pattern": "needle", "path": str(work / "src")}),
        "glob": ("glob", {"pattern": "**/*.py", "path": str(work)}),
    }


def make_tree(work: Path) -> None:
    (work / "src").mkdir()
    for i in range(50):
        body = "".join(f"line {n} of file {i}\n" for n in range(200))
        (work / "src" / f"f{i}.py").write_text(body + ("needle\n" if i % 10 == 0 else ""))


def context(jail: Confinement, cwd: str, cancelled: threading.Event | None = None) -> ToolContext:
    return ToolContext(
        "bench", "run", "toolu", time.monotonic() + 30, cancelled or threading.Event(), cwd=cwd,
        jail=jail,
    )  # fmt: skip


def one_call_ms(
    registry: ToolRegistry, call: tuple[str, dict[str, Any]], ctx: ToolContext
) -> float:
    started = time.perf_counter()
    outcome = registry.run(call[0], call[1], ctx)
    if outcome.status != "ok":
        raise RuntimeError(f"{call[0]} failed: {outcome.output[:200]}")
    return (time.perf_counter() - started) * 1000


def measure_files(
    jail: Confinement, work: Path, rounds: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Per tool: (unsandboxed ms, sandboxed ms), interleaved."""
    registry = register_builtins(ToolRegistry())
    bare_jail = Confinement(bwrap=None, env=jail.env)
    out: dict[str, tuple[list[float], list[float]]] = {}
    for name, call in calls(work).items():
        bare: list[float] = []
        boxed: list[float] = []
        for i in range(rounds + 5):  # the first five warm both sides and are dropped
            pair = [(bare, bare_jail), (boxed, jail)]
            for samples, confinement in pair if i % 2 == 0 else pair[::-1]:
                took = one_call_ms(registry, call, context(confinement, str(work)))
                if i >= 5:
                    samples.append(took)
        out[name] = (bare, boxed)
    return out


# RE2 matches in linear time, but this pattern's automaton outgrows RE2's cache, so
# each 64 KiB line takes a large constant: a grep of `heavy.txt` runs for minutes.
SLOW_PATTERN = "(?:[ab]*a[ab]{30}){30}x"


def cancel_ms(jail: Confinement, work: Path, tries: int) -> tuple[list[float], list[float]]:
    """(cancel -> answered, the next call's time) for a grep that runs for minutes."""
    registry = register_builtins(ToolRegistry())
    slow = work / "heavy.txt"
    random = Random(7)
    with slow.open("w") as out:
        for _ in range(100):
            out.write("".join(random.choices("ab", k=65_000)) + "\n")
    answered: list[float] = []
    after: list[float] = []
    for _ in range(tries):
        cancelled = threading.Event()
        ctx = context(jail, str(work), cancelled)
        done: dict[str, float] = {}
        thread = threading.Thread(target=_run_and_stamp, args=(registry, ctx, slow, done))
        thread.start()
        time.sleep(0.2)  # the grep is running in its server by now
        cancelled.set()
        set_at = time.perf_counter()
        thread.join()
        answered.append((done["at"] - set_at) * 1000)
        after.append(one_call_ms(registry, calls(work)["read_file"], context(jail, str(work))))
    return answered, after


def _run_and_stamp(
    registry: ToolRegistry, ctx: ToolContext, slow: Path, done: dict[str, float]
) -> None:
    outcome = registry.run("grep", {"pattern": SLOW_PATTERN, "path": str(slow)}, ctx)
    done["at"] = time.perf_counter()
    if outcome.status != "cancelled":
        raise RuntimeError(f"the slow grep ended {outcome.status}: {outcome.output[:200]}")


def report(res: Result, jail: Confinement, work: Path, quick: bool) -> None:
    """Add the file tools' rows to the sandbox benchmark's result."""
    make_tree(work)
    rounds = 40 if quick else 200
    for name, (bare, boxed) in measure_files(jail, work, rounds).items():
        res.raw[f"file:{name}"] = {"unsandboxed_ms": bare, "sandboxed_ms": boxed}
        extra = pct(boxed, 50) - pct(bare, 50)
        res.add(
            f"`{name}`: sandbox extra per call, p50",
            extra,
            "ms",
            f"sandboxed p50 {pct(boxed, 50):.2f} / p95 {pct(boxed, 95):.2f} ms vs "
            f"in-process {pct(bare, 50):.2f} / {pct(bare, 95):.2f} ms "
            f"({_ratio(boxed, bare)}x at p50), {rounds} rounds; aim < {TARGET_EXTRA_MS:g}",
            "ok" if extra < TARGET_EXTRA_MS else "MISS",
        )
        res.add(f"`{name}`: sandbox extra per call, p95", pct(boxed, 95) - pct(bare, 95), "ms")
    answered, after = cancel_ms(jail, work, 5 if quick else 15)
    res.raw["file:cancel"] = {"answered_ms": answered, "next_call_ms": after}
    res.add(
        "file call: ui cancel -> answered, p50",
        pct(answered, 50),
        "ms",
        f"p95 {pct(answered, 95):.1f} ms; the server is killed",
    )
    res.add(
        "file call: first call after a cancel, p50",
        pct(after, 50),
        "ms",
        f"p95 {pct(after, 95):.1f} ms; a fresh server starts",
    )


def _ratio(boxed: list[float], bare: list[float]) -> str:
    base = pct(bare, 50)
    return f"{pct(boxed, 50) / base:.1f}" if base > 0 else "n/a"


def writable_jail(jail: Confinement, work: Path) -> Confinement:
    """The benchmark's confinement, its working tree writable (for write_file)."""
    return replace(jail, writable=(str(work),))
