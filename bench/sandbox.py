"""The sandbox's cost per tool call: `execute_command` in bubblewrap vs unsandboxed,
and the file tools in their sandboxed file server vs in-process (`sandbox_files`).

Both sides run the same command through `process.run_command` as the machine worker
does (`true`, and a short `ls | head` pipeline), in interleaved rounds with the order
alternated, so load drift hits both alike. Reported: p50 and p95 per call on each
side and the extra the sandbox adds. Aim: p50 under 5 ms extra. The ui-cancel figures
(cancel -> tool process gone, through the whole fleet) are in `latency`, which runs
sandboxed by default.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench import sandbox_bounds, sandbox_files
from bench.common import Result, pct
from cmdop_worker.machine.process import run_command
from cmdop_worker.machine.sandbox import Confinement, find_bwrap, tool_env

NAME = "sandbox"
TARGET_EXTRA_MS = 5.0
COMMANDS = ("true", "ls -1 / | head -3")


def one_call_ms(command: str, jail: Confinement | None, cwd: str) -> float:
    started = time.perf_counter()
    result = run_command(command, timeout_s=10, cwd=cwd, jail=jail)
    if result.exit_code != 0:
        raise RuntimeError(f"{command!r} failed: {result.stderr.strip()}")
    return (time.perf_counter() - started) * 1000


def measure(command: str, jail: Confinement, rounds: int, cwd: str) -> tuple[list[float], ...]:
    bare: list[float] = []
    boxed: list[float] = []
    for i in range(rounds):
        pair = [(bare, None), (boxed, jail)]
        for samples, confinement in pair if i % 2 == 0 else pair[::-1]:
            samples.append(one_call_ms(command, confinement, cwd))
    return bare, boxed


def run(quick: bool) -> Result:
    res = Result(NAME)
    binary = find_bwrap()
    if binary is None:
        res.error = "no bwrap binary"
        return res
    jail = Confinement(bwrap=binary, env=tool_env(os.environ))
    rounds = 40 if quick else 200
    with tempfile.TemporaryDirectory(prefix="cmdop-bench-sandbox-") as cwd:
        for command in COMMANDS:
            measure(command, jail, 5, cwd)  # warm the page cache for both sides
            bare, boxed = measure(command, jail, rounds, cwd)
            res.raw[command] = {"unsandboxed_ms": bare, "sandboxed_ms": boxed}
            extra_p50 = pct(boxed, 50) - pct(bare, 50)
            res.add(
                f"`{command}`: sandbox extra per call, p50",
                extra_p50,
                "ms",
                f"sandboxed p50 {pct(boxed, 50):.2f} / p95 {pct(boxed, 95):.2f} ms vs "
                f"unsandboxed {pct(bare, 50):.2f} / {pct(bare, 95):.2f} ms, {rounds} rounds;"
                f" aim < {TARGET_EXTRA_MS:g}",
                "ok" if extra_p50 < TARGET_EXTRA_MS else "MISS",
            )
            res.add(
                f"`{command}`: sandbox extra per call, p95",
                pct(boxed, 95) - pct(bare, 95),
                "ms",
            )
        sandbox_bounds.report(res, jail, cwd, rounds)
        sandbox_files.report(res, sandbox_files.writable_jail(jail, Path(cwd)), Path(cwd), quick)
    return res
