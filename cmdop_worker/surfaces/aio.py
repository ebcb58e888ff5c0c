"""The client for asyncio code: `AsyncClient` and `AsyncRun` over the synchronous ones.

Each call runs the synchronous client's in a thread: a cancelled await does not stop
its thread, so pass timeouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from cmdop_worker.core.selectors import Selector
from cmdop_worker.models import Event, MachinePresence, RunResult
from cmdop_worker.surfaces.client import Client, Run


class AsyncClient:
    """`Client` for asyncio code, each call run in a thread: a cancelled await does not
    stop its thread, so pass timeouts."""

    def __init__(self, client: Client) -> None:
        self.sync = client

    @classmethod
    def from_env(cls, **overrides: Any) -> AsyncClient:
        return cls(Client.from_env(**overrides))

    async def submit(self, request: dict[str, Any] | None = None, /, **fields: Any) -> AsyncRun:
        return AsyncRun(await asyncio.to_thread(self.sync.submit, request, **fields))

    async def cancel(self, run_id: str, *, ui: bool = False, reason: str = "user") -> bool:
        return await asyncio.to_thread(self.sync.cancel, run_id, ui=ui, reason=reason)

    async def machines(self, selector: str | Selector | None = None) -> list[MachinePresence]:
        return await asyncio.to_thread(self.sync.machines, selector)


class AsyncRun:
    def __init__(self, run: Run[Any]) -> None:
        self.sync = run

    @property
    def run_id(self) -> str:
        """The run's id: after a steering request, the id of the run it steered."""
        return self.sync.run_id

    async def wait(self, timeout: float | None = None, **options: Any) -> RunResult:
        return await asyncio.to_thread(self.sync.wait, timeout, **options)

    async def output(self, timeout: float | None = None) -> Any:
        return await asyncio.to_thread(self.sync.output, timeout)

    async def cancel(self, *, ui: bool = False, reason: str = "user") -> bool:
        return await asyncio.to_thread(self.sync.cancel, ui=ui, reason=reason)

    async def events(self, **options: Any) -> AsyncIterator[Event]:
        sync_events = self.sync.events(**options)
        while (event := await asyncio.to_thread(next, sync_events, None)) is not None:
            yield event
