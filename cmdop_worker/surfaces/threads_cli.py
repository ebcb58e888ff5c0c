"""`cmdop-worker threads`: list the conversations, show one's runs, delete one.

    cmdop-worker threads [--json]              every live thread, most recent first
    cmdop-worker threads show THREAD [--json]  its runs, oldest first, with their status
    cmdop-worker threads delete THREAD         forget its history (exit 1: it is busy)

An unknown THREAD is said on stderr, exit 2, as every command says an unknown id.

Thin, as the rest of the CLI: parse, call the client, print (what the fleet stored,
prompts included, through `screen.terminal_safe`; `--json` as stored).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from typing import Any

from cmdop_worker.surfaces.follow import EXIT_ERROR, EXIT_OK, EXIT_USAGE
from cmdop_worker.surfaces.screen import terminal_safe


def add_thread_commands(sub: Any) -> None:
    threads = sub.add_parser("threads", help="list, show or delete conversation threads")
    threads.add_argument(
        "action",
        nargs="?",
        choices=["list", "show", "delete"],
        default="list",
        help="list (default), show one thread's runs, or delete one",
    )
    threads.add_argument("thread_id", nargs="?", help="the thread's id (show, delete)")
    threads.add_argument("--json", action="store_true", help="as stored, one JSON per line")


def cmd_threads(args: argparse.Namespace, client: Any) -> int:
    if args.action == "list":
        return _list(client, as_json=args.json)
    if not args.thread_id:
        print(f"cmdop-worker: threads {args.action} needs a THREAD id", file=sys.stderr)
        return EXIT_USAGE
    if args.action == "delete":
        from cmdop_worker.errors import ThreadBusy

        try:
            deleted = client.delete_thread(args.thread_id)
        except ThreadBusy as exc:
            print(f"cmdop-worker: {terminal_safe(str(exc))}", file=sys.stderr)
            return EXIT_ERROR
        if deleted:
            print(f"deleted thread {args.thread_id}")
            return EXIT_OK
        print(f"cmdop-worker: no thread {args.thread_id} (unknown, or expired)", file=sys.stderr)
        return EXIT_USAGE
    return _show(client, args.thread_id, as_json=args.json)


def _list(client: Any, *, as_json: bool) -> int:
    infos = client.threads()
    if as_json:
        for info in infos:
            print(json.dumps(_info_json(info)))
        return EXIT_OK
    if not infos:
        print("no threads")
    for info in infos:
        busy = f", running {info.active}" if info.active else ""
        queued = f", {info.queued} waiting" if info.queued else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.last_used_ms / 1000))
        line = f"{info.thread_id}  {len(info.runs)} run(s){busy}{queued}  last used {when}"
        print(terminal_safe(line))
    return EXIT_OK


def _show(client: Any, thread_id: str, *, as_json: bool) -> int:
    info = client.thread(thread_id)
    if info is None:
        print(f"cmdop-worker: no thread {thread_id} (unknown, or expired)", file=sys.stderr)
        return EXIT_USAGE
    rows = [_run_row(client, run_id) for run_id in info.runs]
    if as_json:
        print(json.dumps({**_info_json(info), "runs": rows}))
        return EXIT_OK
    print(
        f"thread {thread_id}: {len(rows)} run(s)"
        + (f", {info.queued} waiting" if info.queued else "")
    )
    for row in rows:
        # Made safe first: shorten() folds whitespace, and a CR is whitespace to it.
        prompt = textwrap.shorten(terminal_safe(row["prompt"] or ""), 60, placeholder=" …")
        print(terminal_safe(f"  {row['run_id']}  {row['status']:<9}  {prompt}"))
    return EXIT_OK


def _info_json(info: Any) -> dict[str, Any]:
    return {
        "thread_id": info.thread_id,
        "last_used_ms": info.last_used_ms,
        "runs": info.runs,
        "active": info.active,
        "queued": info.queued,
    }


def _run_row(client: Any, run_id: str) -> dict[str, Any]:
    state = client.store.load(run_id)
    result = client.result(run_id)
    status = result.status if result else state.status if state else "expired"
    prompt = state.request.prompt if state else None
    return {"run_id": run_id, "status": status, "prompt": prompt}
