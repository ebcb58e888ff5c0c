"""Fixtures the integration modules share, beyond the session fleet of tests/conftest.py.

`iso` is the isolated fleet of the machine tests: its own redis-server (so its broker
queues and presence keys are apart from the session's), a coordinator, and machines
for a killed worker, each permission mode and a user tool, sharing only the fake model.
Started once for the package and shared by the modules that use it; each test makes
its own run and names its own calls, so none depends on another's state.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, RedisServer

from .machine_runs import Iso, iso_machines


@pytest.fixture(scope="package")
def iso(fleet_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Iso]:
    workdir = tmp_path_factory.mktemp("iso")
    server = RedisServer().start()
    env = {**fleet_env, "CMDOP_REDIS_URL": server.url}
    env.pop("CMDOP_AUDIT_LOG")
    local = LocalFleet(env, logdir=tmp_path_factory.mktemp("iso-logs"))
    machines = iso_machines(workdir)
    try:
        local.start_coordinator()
        for name, extra in machines.items():
            local.start_machine(name, extra)
        local.wait_ready(list(machines), timeout_s=60)
        with Client(Settings(redis_url=server.url)) as client:
            yield Iso(local, client, env, workdir)
    finally:
        local.stop()
        server.stop()
