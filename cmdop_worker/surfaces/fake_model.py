"""`cmdop-worker fake-model`: the scripted model in the foreground, for a fleet by hand.

Serves the fake Anthropic Messages API that ships in `testing` (the one the demo and
the tests use) with the scripts of a file, prints the `ANTHROPIC_BASE_URL` to export on
its first line and how a prompt picks a script, then serves until Ctrl-C or SIGTERM.
A coordinator pointed at it needs no API key (docs/quickstart.md walks through it).
Called by the CLI.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from cmdop_worker.surfaces.follow import EXIT_ERROR, EXIT_OK, EXIT_USAGE
from cmdop_worker.testing.fake_anthropic import FakeAnthropic, ScriptFileError, load_scripts
from cmdop_worker.testing.fake_script import BUILTIN_SCRIPTS, Script

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def banner(url: str, loaded: Iterable[str]) -> list[str]:
    """What the server prints once it listens: the export line first, for `eval`/copying."""
    names = sorted(loaded)
    builtin = ", ".join(sorted(set(BUILTIN_SCRIPTS) - set(names)))
    example = names[0] if names else "demo"
    return [
        f"export ANTHROPIC_BASE_URL={url}",
        f"scripts: {', '.join(names) or '(none loaded)'}; built in: {builtin}",
        f'a prompt picks one with [[script:NAME]]: cmdop-worker run "[[script:{example}]] hello"',
        'any other prompt gets "default", which echoes it back',
        "serving until Ctrl-C",
    ]


def serve_fake_model(
    script_file: Path | None, host: str, port: int, out: TextIO = sys.stdout
) -> int:
    """Serve until interrupted: 0 then, 2 for a bad script file, 1 if it cannot listen."""
    try:
        scripts: dict[str, Script] = load_scripts(script_file) if script_file else {}
    except ScriptFileError as exc:
        print(f"cmdop-worker fake-model: {exc}", file=sys.stderr)
        return EXIT_USAGE
    fake = FakeAnthropic(host=host, port=port, scripts=scripts)
    try:
        fake.start()
    except OSError as exc:
        reason = exc.strerror or exc
        print(f"cmdop-worker fake-model: cannot listen on {host}:{port}: {reason}", file=sys.stderr)
        return EXIT_ERROR
    try:
        with _stop_on_signals() as stop:
            if host not in LOOPBACK:
                # stderr: the export line stays the first line of stdout
                print(
                    f"warning: listening on {host}: anyone who reaches it may use it",
                    file=sys.stderr,
                )
            print("\n".join(banner(fake.url, scripts)), file=out, flush=True)
            while not stop.wait(0.5):  # a bounded wait: the handler runs between waits
                pass
    finally:
        fake.stop()
    print("fake model stopped", file=out, flush=True)
    return EXIT_OK


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGINT or SIGTERM while inside; the old handlers come back after."""
    stop = threading.Event()
    signums = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in signums}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
