"""`python -m bench [--quick] [--only NAME[,NAME]]`: the benchmark suite, one command.

Runs each benchmark in turn (each brings up its own Redis, fake model and fleet),
prints one table and writes `bench/results/latest.json`. Ratios are against baselines
measured in the same invocation on the same machine, interleaved round by round with
what they are compared to (`overhead`, `peers`, `paced`) so load drift hits both alike. Exit
code 1 when a benchmark failed to run (a missed target is reported, not an error).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench.common import Result

BENCHMARKS = {
    "cost": "bench.cost",
    "overhead": "bench.turn_overhead",
    "fanout": "bench.fan_out",
    "peers": "bench.peers",
    "paced": "bench.paced",
    "latency": "bench.latency",
    "throughput": "bench.throughput",
    "scale": "bench.scale",
    "profile": "bench.hotspots",
    "sandbox": "bench.sandbox",
    "ratelimit": "bench.ratelimit",
    "gateway": "bench.gateway",
    "redis": "bench.redis_work",
}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest.json"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer tries, configs")
    parser.add_argument("--only", help=f"comma-separated, of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    chosen = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = [name for name in chosen if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    args.names = chosen
    return args


def run_one(name: str, quick: bool) -> Result:
    started = time.monotonic()
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    try:
        result: Result = importlib.import_module(BENCHMARKS[name]).run(quick)
    except Exception as exc:
        traceback.print_exc()
        result = Result(name, error=f"{type(exc).__name__}: {exc}")
    result.seconds = time.monotonic() - started
    print(f"[bench] {name} done in {result.seconds:.1f} s", file=sys.stderr, flush=True)
    return result


def fmt(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def table(results: list[Result]) -> str:
    header = ("bench", "metric", "value", "unit", "vs", "verdict")
    lines = [header]
    for result in results:
        if result.error:
            lines.append((result.name, "FAILED", "", "", result.error.replace("\n", " ")[:70], ""))
        for row in result.rows:
            lines.append((result.name, row.metric, fmt(row.value), row.unit, row.vs, row.verdict))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        cells = [
            cell.rjust(w) if i == 2 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("| " + " | ".join(cells) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def meta(args: argparse.Namespace, started: float) -> dict[str, object]:
    from importlib.metadata import version

    return {
        "command": "python -m bench " + " ".join(sys.argv[1:]),
        "quick": args.quick,
        "started_unix": started,
        "seconds": time.time() - started,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_end": os.getloadavg(),
        "versions": {p: version(p) for p in ("celery", "kombu", "redis", "anthropic")},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) * 0.5:
        print(
            f"[bench] note: load average {load:.1f} before start; numbers will be noisy",
            file=sys.stderr,
        )
    results = [run_one(name, args.quick) for name in args.names]
    print(table(results))
    report = {
        "meta": {**meta(args, started), "loadavg_start": load},
        "results": {r.name: asdict(r) for r in results},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    total = time.time() - started
    print(f"\n{len(results)} benchmark(s) in {total:.0f} s; JSON in {args.out}", file=sys.stderr)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
