"""`cmdop-worker demo` from a clean environment, as a new user would run it: it runs to
the end and leaves nothing behind — no process, no scratch directory, and on a Redis it
shares no key that would outlive it and no touch of another fleet's queues."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cmdop_worker.surfaces.fleet import RedisServer, free_port

pytestmark = pytest.mark.e2e

# Keys the demo may leave on a shared Redis: its run's Celery result, which expires
# (`result_expires` = the run TTL). Everything else of the demo's is under its prefix.
EXPIRING_LEFTOVERS = ("celery-task-meta-",)


def run_demo(tmp_path: Path, redis_url: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The demo run in a clean environment whose temporary directory is its own."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "TMPDIR": str(scratch),
        "CMDOP_REDIS_URL": redis_url,
    }
    done = subprocess.run(
        [sys.executable, "-m", "cmdop_worker.surfaces.cli", "demo"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert survivors(f"HOME={tmp_path}") == [], "the demo left processes running"
    return done, scratch


def test_demo_runs_to_completion_from_a_clean_environment(tmp_path) -> None:
    # Nothing listens here, so the demo must start a Redis of its own.
    done, scratch = run_demo(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    out = done.stdout + done.stderr
    # Its Redis has a password, never shown.
    assert "started a private Redis at redis://:***@127.0.0.1:" in out
    assert "execute_command on alpha" in out and "execute_command on beta" in out
    assert "alpha: exit_code: 0" in out
    assert "done: 2 turns" in out
    assert sorted(p.name for p in scratch.iterdir()) == [], "the demo left scratch files"


@pytest.fixture
def shared_redis() -> Iterator[tuple[str, redis.Redis]]:
    """A Redis the demo did not start (its URL and a client), already holding another
    fleet's keys."""
    server = RedisServer().start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    client.set("someone-else:data", "keep")
    client.lpush("cmdop.coordinator", "another fleet's queued task")
    client.sadd("_kombu.binding.cmdop.coordinator", "another fleet's binding")
    try:
        yield server.url, client
    finally:
        client.close()
        server.close()


def test_demo_on_a_shared_redis_leaves_no_lasting_key_and_takes_no_task(
    tmp_path, shared_redis
) -> None:
    url, shared = shared_redis
    before = set(shared.keys("*"))
    done, scratch = run_demo(tmp_path, url)
    assert "using the Redis at" in done.stdout + done.stderr
    assert sorted(p.name for p in scratch.iterdir()) == [], "the demo left scratch files"
    assert shared.lrange("cmdop.coordinator", 0, -1) == ["another fleet's queued task"]
    assert shared.get("someone-else:data") == "keep"
    left = {key: shared.ttl(key) for key in set(shared.keys("*")) - before}
    lasting = {k: ttl for k, ttl in left.items() if ttl < 0 or not k.startswith(EXPIRING_LEFTOVERS)}
    assert lasting == {}, f"keys the demo left behind: {lasting}"


def survivors(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `marker` (the demo's children
    inherit its HOME, so any worker or server it failed to stop shows up here)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
        except OSError:
            continue
        if marker.encode() in environ and "State:\tZ" not in status:
            found.append(int(proc.name))
    return found
