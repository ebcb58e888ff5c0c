"""cmdop-worker: run an LLM operator across a fleet of machines.

A coordinator advances each run one turn at a time; machine workers run the tools
addressed to them; Redis holds run state, carries events and the cancel key.

    from cmdop_worker import Client
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "Run", "__version__"]

if TYPE_CHECKING:
    from cmdop_worker.surfaces.aio import AsyncClient
    from cmdop_worker.surfaces.client import Client, Run


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the pure core does not import Celery and Redis.
    if name == "AsyncClient":
        from cmdop_worker.surfaces import aio

        return aio.AsyncClient
    if name in ("Client", "Run"):
        from cmdop_worker.surfaces import client

        return getattr(client, name)
    raise AttributeError(f"module 'cmdop_worker' has no attribute {name!r}")
