"""The Celery application every process of the fleet shares.

`celery -A cmdop_worker.celery_app worker -Q cmdop.coordinator` and Flower load `app`
from here; `cmdop-worker worker` does the same with the right queues and flags. The
settings below are chosen so that a run survives a worker killed at any moment:

- `task_acks_late` + `task_reject_on_worker_lost`: a task is acknowledged only when it
  has finished, so a SIGKILLed worker's task goes back to the queue instead of being
  lost. Every task is idempotent (a turn that already advanced does nothing; a tool
  whose outcome is stored is not run again; one that started but never reported is
  answered "outcome unknown"), so a redelivery is safe.
- `worker_prefetch_multiplier=1`: a worker holds no more unacknowledged messages than
  it is running, so a crash strands as little as possible.
- `visibility_timeout` (Redis broker) above the longest task — a tool may run 600 s —
  or Redis would hand a still-running task to a second worker. All workers share it.
- `worker_cancel_long_running_tasks_on_connection_loss`: a tool with side effects is not
  left running unobserved when the broker connection drops.
- JSON only: a pickled message is refused, never unpickled.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from cmdop_worker.config import Settings
from cmdop_worker.keys import COORDINATOR_QUEUE


def celery_config(settings: Settings) -> dict[str, Any]:
    return {
        "broker_url": settings.effective_broker_url,
        "result_backend": settings.redis_url,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
        },
        "result_backend_transport_options": {"retry_policy": {"timeout": 5.0}},
        "result_expires": settings.run_ttl_s,
        "task_default_queue": COORDINATOR_QUEUE,
        "task_routes": {
            "cmdop.run": {"queue": COORDINATOR_QUEUE},
            "cmdop.turn": {"queue": COORDINATOR_QUEUE},
        },
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "worker_hijack_root_logger": False,
        "task_track_started": True,
        "enable_utc": True,
    }


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings.from_env()
    celery = Celery("cmdop", include=["cmdop_worker.tasks"])
    celery.conf.update(celery_config(settings))
    return celery


app = create_app()
