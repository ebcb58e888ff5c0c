"""`cmdop-worker worker`: start a coordinator or a machine worker (a Celery worker).

    cmdop-worker worker --machine NAME [--label KEY=VALUE ...] [--take-over] [--concurrency N]
    cmdop-worker worker --coordinator [--concurrency N]

Celery is started quiet: instead of its banner (which advises `-E`, though monitors
turn task events on themselves) one line of ours says what starts, as what, on which
queue and Redis (its password masked). Celery's root `SecurityWarning` is folded into
that line as "as root".
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import warnings
from typing import Any

from cmdop_worker import __version__
from cmdop_worker.surfaces.follow import EXIT_OK, EXIT_USAGE
from cmdop_worker.surfaces.machines_cli import add_label_option, machine_labels
from cmdop_worker.surfaces.screen import terminal_safe


def add_worker_command(sub: Any) -> None:
    worker = sub.add_parser("worker", help="run a coordinator or a machine worker")
    role = worker.add_mutually_exclusive_group(required=True)
    role.add_argument(
        "--machine", metavar="NAME", help="run the tools of this machine (its queue only)"
    )
    role.add_argument("--coordinator", action="store_true", help="run the agent loop for any run")
    add_label_option(worker)
    worker.add_argument(
        "--take-over",
        action="store_true",
        help="start even though a live worker holds this machine name "
        "(CMDOP_MACHINE_TAKE_OVER=1); without it such a start is refused (exit 2)",
    )
    worker.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="threads: turns or tool calls at once (default: CMDOP_WORKER_CONCURRENCY)",
    )
    worker.add_argument(
        "--loglevel", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)"
    )


def banner(*, role: str, node: str, queue: str, concurrency: int, redis: str, root: bool) -> str:
    """The one line a worker prints as it starts."""
    as_root = ", as root" if root else ""
    return (
        f"cmdop-worker {__version__}: {role} {node} on queue {queue}, "
        f"{concurrency} threads, Redis {redis}{as_root}"
    )


def cmd_worker(args: argparse.Namespace) -> int:
    if args.machine:
        os.environ["CMDOP_MACHINE"] = args.machine
    else:
        os.environ.pop("CMDOP_MACHINE", None)
    if args.take_over:
        if not args.machine:
            print("cmdop-worker: --take-over goes with --machine", file=sys.stderr)
            return EXIT_USAGE
        os.environ["CMDOP_MACHINE_TAKE_OVER"] = "1"
    from cmdop_worker.config import Settings, masked_url
    from cmdop_worker.models import MACHINE_PATTERN
    from cmdop_worker.state.keys import CONTINUATION_QUEUE, COORDINATOR_QUEUE, machine_queue

    if args.machine and not re.match(MACHINE_PATTERN, args.machine):
        print(f"cmdop-worker: '{args.machine}' is not a valid machine name", file=sys.stderr)
        return EXIT_USAGE
    try:
        labels = machine_labels(
            os.environ.get("CMDOP_MACHINE_LABELS", ""), args.label, machine=bool(args.machine)
        )
    except ValueError as exc:
        print(f"cmdop-worker: invalid labels: {terminal_safe(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    os.environ["CMDOP_MACHINE_LABELS"] = labels
    settings = Settings.from_env()
    from celery.exceptions import SecurityWarning

    from cmdop_worker.celery_app import app

    coordinator = f"{COORDINATOR_QUEUE},{CONTINUATION_QUEUE}"
    queue = machine_queue(args.machine) if args.machine else coordinator
    name = args.machine or f"coordinator-{os.getpid()}"
    node = f"{name}@{settings.hostname or socket.gethostname()}"
    concurrency = args.concurrency or settings.worker_concurrency
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    line = banner(
        role="machine worker" if args.machine else "coordinator",
        node=node,
        queue=queue,
        concurrency=concurrency,
        redis=masked_url(settings.redis_url),
        root=root,
    )
    print(terminal_safe(line), flush=True)
    warnings.filterwarnings("ignore", category=SecurityWarning)
    argv = [
        "--quiet",  # no Celery banner: ours is the line above
        "worker",
        "-Q",
        queue,
        "-n",
        node,
        "-P",
        "threads",
        "-c",
        str(concurrency),
        "-l",
        args.loglevel,
        *(["-E"] if settings.task_events else []),
        "--without-mingle",
        "--without-gossip",
    ]
    app.worker_main(argv)
    return EXIT_OK
