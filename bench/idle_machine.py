"""`python -m bench.idle_machine [SECONDS]`: Redis commands an idle machine worker sends.

Starts a private redis-server and one machine worker (`cmdop-worker worker --machine
idle-1`, sandbox off), waits for its presence, lets it settle, then counts for SECONDS
(default 30): `INFO commandstats` (every command the server ran, scripts' included)
and MONITOR (split into what clients sent and what ran inside scripts). The counting
clients' own commands (HELLO, CONFIG, INFO) are left out. The issue's aim: at most 2
a second, Celery's own polling included.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from typing import Any

import redis

from cmdop_worker.surfaces.fleet import RedisServer

OURS = {"hello", "config|resetstat", "info", "monitor", "client|setinfo"}


def main(window_s: float) -> None:
    found = measure(window_s)
    print(f"commandstats: {found['ran_per_s']:.2f}/s {found['ran']}")
    print(f"sent by the worker: {found['sent_per_s']:.2f}/s {found['sent']}")
    print(f"inside scripts: {found['scripted_per_s']:.2f}/s {found['scripted']}")


def measure(window_s: float) -> dict[str, Any]:
    """The idle worker's commands over `window_s` seconds: per second (`ran_per_s`, every
    command the server ran; `sent_per_s`, what the worker sent; `scripted_per_s`, what
    ran inside its scripts) and by command name."""
    server = RedisServer().start()
    r = redis.Redis.from_url(server.url, decode_responses=True)
    env = {
        **os.environ,
        "CMDOP_REDIS_URL": server.url,
        "CMDOP_SANDBOX": "off",
        "CMDOP_ALLOW_OPEN_REDIS": "1",
    }
    argv = [sys.executable, "-m", "cmdop_worker.surfaces.cli", "worker", "--machine", "idle-1"]
    worker = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        give_up = time.monotonic() + 60
        while not r.exists("cmdop:machine:idle-1"):
            if time.monotonic() > give_up:
                raise SystemExit("the worker announced no presence")
            time.sleep(0.2)
        time.sleep(3)
        sent: collections.Counter[str] = collections.Counter()
        scripted: collections.Counter[str] = collections.Counter()
        stop = time.monotonic() + window_s
        watcher = threading.Thread(target=_watch, args=(server.url, stop, sent, scripted))
        watcher.start()
        r.config_resetstat()
        time.sleep(window_s)
        stats = {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
        watcher.join(timeout=window_s)
        ran = {k: v for k, v in stats.items() if k not in OURS}
        return {
            "window_s": window_s,
            "ran_per_s": sum(ran.values()) / window_s,
            "sent_per_s": sum(sent.values()) / window_s,
            "scripted_per_s": sum(scripted.values()) / window_s,
            "ran": ran,
            "sent": dict(sent),
            "scripted": dict(scripted),
        }
    finally:
        worker.terminate()
        worker.wait(30)
        r.close()
        server.stop()


def _watch(
    url: str, stop: float, sent: collections.Counter[str], scripted: collections.Counter[str]
) -> None:
    with redis.Redis.from_url(url, decode_responses=True).monitor() as monitor:
        for event in monitor.listen():
            if time.monotonic() > stop:
                return
            words = event["command"].split()
            name = words[0].upper() if words else "?"
            if name in {"CONFIG", "INFO"}:
                continue
            where = scripted if event.get("client_type") == "lua" else sent
            where[name] += 1


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
