"""Another service starts a run and follows it with plain Celery and redis-py only.

The child process is what such a service looks like: `python -I` from an empty
directory, `cmdop_worker` made unimportable (the venv holds an editable install, so
a meta path finder refuses it, and the child checks that it does), a bare
`celery.Celery(broker=...)`, and `XREAD` on the run's event stream until the terminal
event. Everything it relies on is in docs: the task name, the queue, the request
fields, the stream key and the event JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.e2e

FOREIGN_SERVICE = r"""
import importlib.abc
import json
import sys
import time


class NoCmdop(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "cmdop_worker":
            raise ImportError(f"{name}: not available to a foreign service")
        return None


sys.meta_path.insert(0, NoCmdop())
try:
    import cmdop_worker  # noqa: F401
except ImportError:
    print("cmdop_worker: not importable", file=sys.stderr)
else:
    sys.exit("cmdop_worker was importable in the foreign service")

import celery
import redis

broker_url, run_id, prompt = sys.argv[1:4]
app = celery.Celery("foreign", broker=broker_url)
request = {"run_id": run_id, "prompt": prompt, "machine": "alpha", "timeout_s": 60}
app.send_task("cmdop.run", kwargs={"request": request}, queue="cmdop.coordinator")

r = redis.Redis.from_url(broker_url, decode_responses=True, socket_timeout=None)
stream, last_id = f"cmdop:run:{run_id}:events", "0-0"
give_up = time.monotonic() + 45
while time.monotonic() < give_up:
    reply = r.xread({stream: last_id}, block=1000, count=100)
    if not reply:
        continue
    rows = reply[stream] if isinstance(reply, dict) else reply[0][1]
    if rows and isinstance(rows[0], list) and len(rows) == 1 and isinstance(rows[0][0], list):
        rows = rows[0]
    for entry_id, fields in rows:
        last_id = entry_id
        event = json.loads(fields["event"])
        print(json.dumps(event), flush=True)
        if event["type"] in ("DONE", "ERROR", "CANCELLED"):
            leaked = sorted(m for m in sys.modules if m.startswith("cmdop_worker"))
            sys.exit(f"imported {leaked}" if leaked else 0)
sys.exit("no terminal event within 45 s")
"""


def test_a_service_without_cmdop_worker_starts_and_follows_a_run(
    fleet, fleet_env, script, tmp_path
) -> None:
    prompt = script(
        [
            [
                {"type": "text", "text": "checking alpha"},
                {"type": "tool_use", "name": "execute_command", "input": {"command": "uname -s"}},
            ],
            [{"type": "text", "text": "alpha runs {{result:0}}"}],
        ]
    )
    service = tmp_path / "foreign_service.py"
    service.write_text(FOREIGN_SERVICE)
    run_id = f"foreign-{uuid.uuid4().hex[:10]}"
    done = subprocess.run(
        [sys.executable, "-I", str(service), fleet_env["CMDOP_REDIS_URL"], run_id, prompt],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr + fleet.logs()
    assert "cmdop_worker: not importable" in done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["run_id"] == run_id for e in events)
    tool_end = next(e for e in events if e["type"] == "TOOL_END")
    assert tool_end["data"]["machine"] == "alpha" and not tool_end["data"]["is_error"]
    final = events[-1]
    assert final["type"] == "DONE", final
    assert final["data"]["text"].startswith("alpha runs ")
    assert "Linux" in final["data"]["text"]
    assert final["data"]["turns"] == 2
