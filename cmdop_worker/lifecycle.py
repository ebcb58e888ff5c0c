"""What a worker process starts and stops besides Celery itself.

A machine worker (settings.machine set) advertises its presence with a heartbeat; a
coordinator runs the watchdog. Both start when Celery says the worker is ready and
stop with it. When Celery sets up logging, the structured format of `logs` is put on
its handlers. Traces (`tracing`) are set up at worker init and flushed at shutdown.
Connected by importing this module (`tasks` does).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Any, NoReturn

from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    task_postrun,
    task_prerun,
    worker_init,
    worker_ready,
    worker_shutdown,
)

from cmdop_worker import logs, metrics, runtime, tracing
from cmdop_worker.models import MachinePresence

log = logging.getLogger(__name__)

_lock = threading.Lock()
_services: list[Any] = []
_side: Any = None
_open_redis = False  # started against an open Redis, as the operator allowed


def machine_side() -> Any:
    """This process's `MachineSide`: the machine's name, registry and policy."""
    global _side
    from cmdop_worker.machine.registry import load_tool_modules
    from cmdop_worker.machine.side import MachineSide, scrub_environment

    with _lock:
        if _side is None:
            rt = runtime.current()
            if rt.settings.machine is None:
                raise RuntimeError("this worker is not a machine worker (CMDOP_MACHINE unset)")
            registry = load_tool_modules(rt.settings.tool_modules)
            for name in registry.unsandboxed():
                log.warning(
                    "tool %s is registered with sandbox=False: it runs inside this worker's "
                    "process, unsandboxed, with the worker's rights, files and network",
                    name,
                )
            _side = MachineSide(rt, rt.settings.machine, registry)
            _side.tool_env  # noqa: B018  (the operator's pass-through, read before the scrub)
            scrub_environment(os.environ)
        return _side


@after_setup_logger.connect
@after_setup_task_logger.connect
def _structured_logs(logger: logging.Logger, **_: Any) -> None:
    machine = runtime.current().settings.machine
    logs.install(logger, json_lines=logs.LogSettings().json_lines, machine=machine)
    logs.log_thread_crashes()


@task_prerun.connect
@task_postrun.connect
def _clear_log_context(**_: Any) -> None:
    # Threads of the pool are reused: no task may inherit the previous one's context.
    logs.clear()


@worker_init.connect
def _check_config(**_: Any) -> None:
    """Every configuration file this worker reads is checked before it takes any task:
    a bad one stops it with one line naming the file, the line and the problem (exit 2),
    instead of failing the first task that reads it."""
    from cmdop_worker.config import ConfigFileError

    rt = runtime.current()
    try:
        if rt.settings.machine is not None:
            machine_side().policy  # noqa: B018  (read, checked and kept, here)
        else:
            rt.agents  # noqa: B018
            rt.hide_map  # noqa: B018
    except ConfigFileError as exc:
        _refuse(str(exc))


def _refuse(message: str) -> NoReturn:
    """Stop a worker that must not start: one line in its log and on stderr, exit 2
    (a unit's `RestartPreventExitStatus=2` then does not start it again and again)."""
    log.critical("refusing to start: %s", message)
    print(f"cmdop worker: refusing to start: {message}", file=sys.stderr, flush=True)
    # SystemExit, not an exception: Celery's signal dispatch logs and swallows those.
    raise SystemExit(2) from None


@worker_init.connect
def _start_tracing(**_: Any) -> None:
    if tracing.setup(runtime.current().settings):
        log.info("exporting traces over OTLP/HTTP (OTEL_EXPORTER_OTLP_ENDPOINT)")


@worker_init.connect
def _check_sandbox(**_: Any) -> None:
    """A machine worker whose tool sandbox cannot start does not start at all."""
    if runtime.current().settings.machine is None:
        return
    from cmdop_worker.machine.side import SandboxUnavailable

    try:
        machine_side().bwrap  # noqa: B018  (found and probed once, here)
        machine_side().bounds  # noqa: B018  (the calls' limits: how they are held, logged)
    except SandboxUnavailable as exc:
        _refuse(str(exc))


@worker_init.connect
def _check_name(**_: Any) -> None:
    """One machine name, one worker: a machine worker does not start under a name whose
    presence is live, naming the host and pid holding it, unless told to take it over.
    A presence of this host whose pid is gone (or is this process) is this worker's own
    from before a crash, still within its TTL: that one is no holder."""
    rt = runtime.current()
    machine = rt.settings.machine
    if machine is None or rt.settings.machine_take_over:
        return
    from cmdop_worker.core.machine_names import name_held
    from cmdop_worker.state.connect import RedisError
    from cmdop_worker.state.presence import parse_presence

    key = rt.keys.machine(machine)
    try:
        raw = rt.redis.get(key)
    except RedisError as exc:  # the heartbeat's own retries deal with Redis
        log.warning("could not check whether machine name %s is held: %s", machine, exc)
        return
    holder = None if raw is None else parse_presence(raw, source=key)
    if holder is None or not _live_elsewhere(holder.host, holder.pid, rt.settings.hostname):
        return
    _refuse(name_held(machine, holder.host, holder.pid))


def _live_elsewhere(host: str, pid: int, configured_host: str | None) -> bool:
    """Whether a presence's worker may be alive and is not this process: another host
    is taken at its word (its presence is live); on this host, its pid must run."""
    if host != (configured_host or socket.gethostname()):
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # running, as another user
        return True
    return True


@worker_init.connect
def _check_redis(**_: Any) -> None:
    """A machine worker whose tools have network does not start against an open Redis,
    unless the operator allowed it (then once more in its presence)."""
    global _open_redis
    settings = runtime.current().settings
    if settings.machine is None:
        return
    from cmdop_worker.machine.policy import tools_have_network
    from cmdop_worker.machine.redis_guard import anonymous_access, open_redis_verdict

    side = machine_side()
    url = settings.redis_url
    verdict = open_redis_verdict(
        url,
        answers_anonymous=anonymous_access(url),
        tools_networked=tools_have_network(side.policy, sandboxed=side.bwrap is not None),
        allow_open=settings.allow_open_redis,
    )
    if verdict.verdict == "refuse":
        _refuse(verdict.message)
    if verdict.verdict == "warn":
        log.warning("%s", verdict.message)
        _open_redis = True


@worker_ready.connect
def _start_services(**_: Any) -> None:
    rt = runtime.current()
    if rt.settings.machine is not None:
        from cmdop_worker.state.presence import Heartbeat

        side = machine_side()
        presence = MachinePresence(
            machine=side.machine,
            host=rt.settings.hostname or socket.gethostname(),
            pid=os.getpid(),
            started_ms=runtime.now_ms(),
            tools=side.registry.specs(),
            sandbox=side.sandbox_label,
            open_redis=_open_redis,
            labels=rt.settings.machine_labels,
        )
        service: Any = Heartbeat(
            rt.redis,
            rt.keys,
            presence,
            ttl_s=rt.settings.presence_ttl_s,
            refresh_s=rt.settings.presence_refresh_s,
        )
        rt.hub  # noqa: B018  (subscribe before the first call arrives)
        if side.egress is not None:  # started now, not by the first call with network
            _services.append(side.egress)
        if side.bounds is not None:
            log.info("%s", side.bounds.summary)
        if side.bwrap is not None and side.registry.jailed():
            from cmdop_worker.machine.tooljail import warm

            warm(side.jail_for("allow"), side.cwd)  # the first call finds a server ready
    else:
        from cmdop_worker.coordinator.watchdog import Watchdog

        service = Watchdog(rt)
        from cmdop_worker.llm.client import NO_CREDENTIALS, has_model_endpoint, model_client

        model_client(rt)  # load the SDK now, not during the first run's turn
        if not has_model_endpoint(rt.settings):
            log.warning("%s; until then every run fails at its first model call", NO_CREDENTIALS)
    service.start()
    metrics.serve(rt.settings.metrics_port, rt.settings.metrics_addr)
    _services.append(service)
    log.info("cmdop worker ready (%s)", rt.settings.machine or "coordinator")


@worker_shutdown.connect
def _stop_services(**_: Any) -> None:
    while _services:
        _services.pop().stop()
    tracing.shutdown()
