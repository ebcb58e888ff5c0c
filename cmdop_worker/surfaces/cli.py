"""`cmdop-worker`: run, follow, cancel and approve runs; start workers; the demo.

Thin: parse the arguments, call the client (or Celery, for `worker`), render.
`main(argv) -> exit code`; exit codes of `run`: 0 DONE, 1 ERROR (or not started within
`--timeout`), 130 CANCELLED; 2 a request or an answer refused. Every command says an
unknown id (a run, a call, a thread) on stderr and exits 2; every command that finds
Redis unreachable says so in one line and exits 1. `run` reads its prompt from the
argument, from stdin (`run -`) or from `--prompt-file`, refused past the request's limit.
What the fleet said (names, messages, machines' tool lists) is printed through
`screen.terminal_safe`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cmdop_worker import __version__
from cmdop_worker.surfaces.acl_cli import add_acl_command, cmd_acl
from cmdop_worker.surfaces.follow import (
    EXIT_CANCELLED,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    follow,
)
from cmdop_worker.surfaces.machines_cli import add_machines_command, cmd_machines
from cmdop_worker.surfaces.screen import terminal_safe
from cmdop_worker.surfaces.threads_cli import add_thread_commands, cmd_threads
from cmdop_worker.surfaces.worker_cli import add_worker_command, cmd_worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cmdop-worker", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start a run and follow it")
    run.add_argument(
        "prompt", nargs="?", help="the message; - reads it from stdin (or use --prompt-file)"
    )
    run.add_argument(
        "--prompt-file", type=Path, metavar="PATH", help="read the message from this file"
    )
    run.add_argument("--machine", help="target machine: its tools run there by default")
    run.add_argument(
        "--agent", default="operator", help="agent profile (default: operator; see agents.toml)"
    )
    run.add_argument("--model", help="a model alias from the configuration, or a model id")
    run.add_argument("--max-turns", type=int, metavar="N", help="at most N model turns (1-100)")
    run.add_argument(
        "--timeout",
        type=float,
        dest="timeout_s",
        metavar="SECONDS",
        help="deadline for the whole run, from now (default 300); not started by then: cancelled",
    )
    run.add_argument("--json", action="store_true", help="one event JSON per line")
    run.add_argument("--thread", dest="thread_id", help="continue this conversation")
    run.add_argument(
        "--on-busy",
        choices=["reject", "enqueue", "interrupt", "steer"],
        help="when the thread has a running run (default: reject)",
    )

    events = sub.add_parser("events", help="replay and follow a run's events")
    events.add_argument("run_id", help="the run's id")
    events.add_argument("--json", action="store_true", help="one event JSON per line")

    cancel = sub.add_parser("cancel", help="cancel a run")
    cancel.add_argument("run_id", help="the run's id")
    cancel.add_argument("--ui", action="store_true", help="stop at once, killing running tools")
    cancel.add_argument("--reason", default="user", help="why: recorded in CANCELLED")

    approve = sub.add_parser("approve", help="answer a tool call's approval request")
    approve.add_argument("run_id", help="the run's id")
    approve.add_argument("tool_call_id", help="the waiting call's id (in APPROVAL_REQUEST)")
    answer = approve.add_mutually_exclusive_group()
    answer.add_argument("--input", help="run the call with these arguments (JSON) instead")
    answer.add_argument("--deny", action="store_true", help="refuse the call")
    approve.add_argument("--reason", help="why it is denied: the model is told")
    approve.add_argument("--by", help="who answers (default: the OS user)")

    add_machines_command(sub)
    add_thread_commands(sub)
    add_acl_command(sub)
    chat = sub.add_parser("chat", help="a conversation on a thread, in the terminal")
    chat.add_argument("--machine", help="target machine of the thread's runs")
    chat.add_argument("--thread", dest="thread_id", help="continue this thread")

    add_worker_command(sub)

    sub.add_parser("demo", help="bring up a local fleet with a scripted model and run once")

    fake = sub.add_parser("fake-model", help="serve the scripted model (no API key needed)")
    fake.add_argument("--script", type=Path, help="a script file (TOML, or JSON)")
    fake.add_argument("--host", default="127.0.0.1", help="address to listen on")
    fake.add_argument("--port", type=int, default=8765, help="port to listen on")

    gateway = sub.add_parser("gateway", help="serve the HTTP API and the run viewer page")
    gateway.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (beyond loopback: tokens)"
    )
    gateway.add_argument("--port", type=int, default=8080, help="port to listen on")

    schema = sub.add_parser("schema", help="print a JSON Schema")
    schema.add_argument("which", choices=["run-request", "event"], help="which schema")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {
        "run": cmd_run,
        "events": cmd_events,
        "cancel": cmd_cancel,
        "approve": cmd_approve,
        "machines": lambda args: cmd_machines(args, _client()),
        "threads": lambda args: cmd_threads(args, _client()),
        "chat": cmd_chat,
        "worker": cmd_worker,
        "demo": cmd_demo,
        "fake-model": cmd_fake_model,
        "gateway": cmd_gateway,
        "schema": cmd_schema,
        "acl": cmd_acl,
    }[args.command]
    try:
        return int(handler(args))
    except KeyboardInterrupt:
        return EXIT_CANCELLED
    except Exception as exc:
        unreachable = redis_unreachable(exc)
        if unreachable is None:
            raise
        print(unreachable, file=sys.stderr)
        return EXIT_ERROR


def redis_unreachable(exc: BaseException) -> str | None:
    """The one line that replaces a traceback when Redis cannot be reached; None when
    `exc` is something else. The URL is shown with its password masked."""
    from cmdop_worker.config import Settings, masked_url
    from cmdop_worker.state.connect import RedisConnectionError, RedisTimeoutError

    if not isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return None
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, RedisTimeoutError):
        why = "timed out"
    elif isinstance(cause, OSError) and cause.strerror:
        why = cause.strerror
    else:
        why = str(exc).rstrip(".")
    url = masked_url(Settings.from_env().redis_url)
    why = terminal_safe(why)
    return f"cmdop-worker: cannot reach Redis at {url} ({why}); is it running? set CMDOP_REDIS_URL"


def entrypoint() -> None:
    try:
        code = main()
    except KeyboardInterrupt:
        code = EXIT_CANCELLED
    # A Ctrl-C that lands while the process is already exiting must not turn a clean
    # exit into a traceback or a death by SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


def _client() -> Any:
    from cmdop_worker.surfaces.client import Client

    return Client.from_env()


def _view(as_json: bool) -> Any:
    from rich.console import Console

    from cmdop_worker.surfaces.render import JsonView, LiveView

    return JsonView(sys.stdout) if as_json else LiveView(Console(highlight=False))


def cmd_run(args: argparse.Namespace) -> int:
    from cmdop_worker.errors import InvalidRequest

    prompt = read_prompt(args.prompt, args.prompt_file)
    if prompt.error is not None:
        print(f"cmdop-worker: {prompt.error}", file=sys.stderr)
        return EXIT_USAGE
    fields = {
        "prompt": prompt.text,
        "machine": args.machine,
        "agent": args.agent,
        "model": args.model,
        "max_turns": args.max_turns,
        "timeout_s": args.timeout_s,
        "thread_id": args.thread_id,
        "on_busy": args.on_busy,
    }
    client = _client()
    try:
        run = client.submit({k: v for k, v in fields.items() if v is not None})
    except InvalidRequest as exc:
        print(f"cmdop-worker: {terminal_safe(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    view = _view(args.json)
    view.begin(run.run_id)
    for warning in run.warnings:  # such as: its machine is known but offline now
        print(f"cmdop-worker: warning: {terminal_safe(warning)}", file=sys.stderr, flush=True)
    if not client.coordinators_online():
        print(
            "cmdop-worker: warning: no coordinator is running (none registered in Redis); "
            "the run starts when one does: cmdop-worker worker --coordinator",
            file=sys.stderr,
            flush=True,
        )
    return follow(
        client,
        run.run_id,
        view,
        cancel_on_interrupt=True,
        start_within_s=args.timeout_s,
        submitted=True,  # a Ctrl-C while the run is still queued cancels it as it starts
    )


@dataclass(frozen=True)
class Prompt:
    text: str = ""
    error: str | None = None


def read_prompt(arg: str | None, path: Path | None) -> Prompt:
    """The prompt of `run`: the argument, stdin for `-`, or `--prompt-file`; read up
    to one character past the request's limit, so a longer one is refused unread."""
    from cmdop_worker.models import MAX_PROMPT_CHARS

    if (arg is None) == (path is None):
        return Prompt(error="give the prompt as an argument, - for stdin, or --prompt-file PATH")
    if arg is not None and arg != "-":
        return Prompt(arg)
    where = "stdin" if path is None else str(path)
    try:
        if path is None:
            text = sys.stdin.read(MAX_PROMPT_CHARS + 1)
        else:
            with path.open(encoding="utf-8") as file:
                text = file.read(MAX_PROMPT_CHARS + 1)
    except UnicodeDecodeError:
        return Prompt(error=f"the prompt in {where} is not UTF-8 text")
    except OSError as exc:
        return Prompt(error=f"cannot read {where}: {exc.strerror or exc}")
    if len(text) > MAX_PROMPT_CHARS:
        return Prompt(
            error=f"the prompt in {where} is over the limit of {MAX_PROMPT_CHARS} characters"
        )
    if not text.strip():
        return Prompt(error=f"the prompt in {where} is empty")
    return Prompt(text)


def cmd_chat(args: argparse.Namespace) -> int:
    from cmdop_worker.surfaces.chat import run_chat

    return run_chat(_client(), thread_id=args.thread_id, machine=args.machine)


def cmd_events(args: argparse.Namespace) -> int:
    client = _client()
    if not _run_appears(client, args.run_id, within_s=5.0):
        print(f"cmdop-worker: no run {args.run_id} (unknown, or expired)", file=sys.stderr)
        return EXIT_USAGE
    return follow(client, args.run_id, _view(args.json))


def _run_appears(client: Any, run_id: str, *, within_s: float) -> bool:
    """Whether the run exists, waiting a little for one just submitted."""
    keys = (client.keys.state(run_id), client.keys.events(run_id), client.keys.result(run_id))
    give_up = time.monotonic() + within_s
    while not client.redis.exists(*keys):
        if time.monotonic() >= give_up:
            return False
        time.sleep(0.1)
    return True


def cmd_cancel(args: argparse.Namespace) -> int:
    client = _client()
    if client.cancel(args.run_id, ui=args.ui, reason=args.reason):
        print(f"cancel ({'ui' if args.ui else 'operation'}) sent to run {args.run_id}")
        return EXIT_OK
    result = client.result(args.run_id)
    if result is not None:  # nothing to do, and nothing wrong: a cancel is idempotent
        print(f"run {args.run_id} has already ended ({result.status}); nothing to cancel")
        return EXIT_OK
    print(f"cmdop-worker: no run {args.run_id} (unknown, or expired)", file=sys.stderr)
    return EXIT_USAGE


def cmd_approve(args: argparse.Namespace) -> int:
    from cmdop_worker.errors import ApprovalNotPending, InvalidRequest, RunNotFound
    from cmdop_worker.surfaces.approvals import by_problem

    try:
        if args.reason is not None and not args.deny:
            raise InvalidRequest("--reason goes with --deny: it tells the model why")
        if args.by is not None and (problem := by_problem(args.by)) is not None:
            raise InvalidRequest(f"--by {problem}")
        edited = json.loads(args.input) if args.input is not None else None
        asked = _client().approve(
            args.run_id,
            args.tool_call_id,
            approve=not args.deny,
            input=edited,
            reason=args.reason,
            by=args.by,
        )
    except json.JSONDecodeError as exc:
        print(f"cmdop-worker: --input is not JSON: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (RunNotFound, ApprovalNotPending, InvalidRequest) as exc:
        print(f"cmdop-worker: {terminal_safe(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    where = f" on {asked.machine}" if asked.machine else ""
    verdict = "denied" if args.deny else "approved"
    edited_note = " with the edited input" if args.input is not None else ""
    said = f"{verdict} tool call {args.tool_call_id} ({asked.tool}{where}) of run {args.run_id}"
    print(terminal_safe(said) + edited_note)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from cmdop_worker.surfaces.demo import run_demo

    return run_demo()


def cmd_fake_model(args: argparse.Namespace) -> int:
    from cmdop_worker.surfaces.fake_model import serve_fake_model

    return serve_fake_model(args.script, args.host, args.port)


def cmd_gateway(args: argparse.Namespace) -> int:
    from cmdop_worker.surfaces.gateway import serve

    return serve(args.host, args.port)


def json_schema(which: str) -> dict[str, Any]:
    """The JSON Schema `cmdop-worker schema WHICH` prints (copies kept in schemas/)."""
    from cmdop_worker.models import RunRequest
    from cmdop_worker.surfaces.typed_events import event_json_schema

    if which == "event":
        return event_json_schema()
    return RunRequest.model_json_schema()


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(args.which), indent=2, sort_keys=True))
    return EXIT_OK


if __name__ == "__main__":
    entrypoint()
