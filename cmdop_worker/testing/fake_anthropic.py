"""A local fake of the Anthropic Messages API, for tests, benchmarks and the demo.

The real `anthropic` SDK reaches it through `base_url=` or `ANTHROPIC_BASE_URL`.
Owns the HTTP shell only: sockets, sleeps, ids, recordings, the fault queue and the
control API. What to answer is decided by the pure `fake_script` module, which also
documents the script and fault formats and the cache approximation.

Routes (query strings ignored):
    POST /v1/messages            JSON, or SSE when the body has "stream": true
    PUT  /_fake/scripts/<name>   a script (see fake_script)
    PUT  /_fake/default          {"script": name}
    POST /_fake/faults           one fault or a list, consumed FIFO by the next requests
    PUT  /_fake/rate_limit       limits per model (`fake_limits.RateLimit`; null: defaults),
                                 e.g. {"requests": 240, "short_interval_s": 1}: 240 a
                                 minute, at most 4 in any second, as the API enforces it
    GET  /_fake/requests         the recordings of /v1/* requests
    POST /_fake/reset            clear faults, recordings, cache and limits; keep scripts
    GET  /_fake/health

CLI: `python -m cmdop_worker.testing.fake_anthropic --port P [--script-file F]
[--pace-tps [TPS]]` prints `http://127.0.0.1:P` once listening and serves until SIGTERM
or SIGINT. A script file (`load_scripts`) is JSON, or TOML when its name ends in
`.toml`: `{name: script, ...}`. `--pace-tps` paces every script that sets no pace.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cmdop_worker.testing import fake_script as fs
from cmdop_worker.testing.fake_http import _Handler, _Server
from cmdop_worker.testing.fake_script import Fault, JsonDict, Script, ScriptFileError
from cmdop_worker.testing.fake_state import _State

__all__ = ["FakeAnthropic", "ScriptFileError", "_Handler", "_State", "load_scripts", "main"]

log = logging.getLogger(__name__)


class FakeAnthropic:
    """A fake Messages API server on a daemon thread; also a context manager."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        scripts: Mapping[str, Script | Sequence[Any] | Mapping[str, Any]] | None = None,
        default_script: str = "default",
        pace_tps: float = 0.0,
    ) -> None:
        """`pace_tps`: output tokens per second for scripts and turns that set none
        (`fake_script`; 0: unpaced, `DEFAULT_PACE_TPS` is about the real API's)."""
        self._address = (host, port)
        self._state = _State(pace_tps)
        for name, script in (scripts or {}).items():
            self.add_script(name, script)
        self.set_default(default_script)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FakeAnthropic:
        self._state.stopping.clear()
        server = _Server(self._address, _Handler)
        server.state = self._state
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.02},
            daemon=True,
            name="fake-anthropic",
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._state.stopping.set()  # wakes stalled handlers
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeAnthropic is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def add_script(self, name: str, script: Script | Sequence[Any] | Mapping[str, Any]) -> None:
        self._state.add_script(name, script)

    def set_default(self, name: str) -> None:
        self._state.set_default(name)

    def inject(self, *faults: Fault | Mapping[str, Any]) -> None:
        self._state.inject(fs.parse_faults(list(faults)))

    def set_rate_limit(self, **limits: Any) -> None:
        """Limits per model, e.g. `requests=5, window_s=1`, or `requests=240,
        short_interval_s=1` (a per-minute bucket also enforced per second, as the API
        does it; `fake_limits`). None given: the defaults."""
        self._state.set_rate_limit(limits or None)

    def requests(self) -> list[JsonDict]:
        """Recordings of /v1/* requests, oldest first (copies)."""
        return self._state.snapshot()

    def reset(self) -> None:
        self._state.reset()

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def load_scripts(path: Path) -> dict[str, Script]:
    """The scripts of a file; `ScriptFileError` names the file and what is wrong with it."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ScriptFileError(f"{path}: cannot read it ({reason})") from None
    toml = path.suffix == ".toml"
    try:
        data = tomllib.loads(text) if toml else json.loads(text)
    except ValueError as exc:  # TOMLDecodeError and JSONDecodeError both are
        raise ScriptFileError(f"{path}: not valid {'TOML' if toml else 'JSON'}: {exc}") from None
    try:
        return fs.parse_scripts(data)
    except ScriptFileError as exc:
        raise ScriptFileError(f"{path}: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A local fake of the Anthropic Messages API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--script-file", type=Path, help='JSON or TOML: {"name": script, ...}')
    parser.add_argument("--default", default="default", help="the default script's name")
    parser.add_argument(
        "--pace-tps",
        type=float,
        nargs="?",
        const=fs.DEFAULT_PACE_TPS,
        default=0.0,
        help=f"write output at this many tokens/s (alone: {fs.DEFAULT_PACE_TPS:g}); else unpaced",
    )
    args = parser.parse_args(argv)
    scripts = load_scripts(args.script_file) if args.script_file else {}
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with FakeAnthropic(
        host=args.host,
        port=args.port,
        scripts=scripts,
        default_script=args.default,
        pace_tps=args.pace_tps,
    ) as fake:
        print(fake.url, flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
