"""What every step of one turn's execution reads: the turn context.

Built once by `coordinator.turn.execute_turn` when it holds the turn's lease, and
passed to each step of the turn (`prepare`, `model_call`, `reply`) in place of the
runtime, run id, turn and attempt each would otherwise take one by one. The tool
catalogue is read from the fleet's presence at most once per turn, when a step first
needs it (a turn that ends before its model call reads none).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from cmdop_worker.core import tools
from cmdop_worker.core.catalog import fleet_catalog
from cmdop_worker.models import ToolSpec
from cmdop_worker.runtime import Runtime
from cmdop_worker.state.presence import online_machines
from cmdop_worker.state.store import RunState


@dataclass(frozen=True)
class TurnContext:
    """One execution of one turn. `state`: the run as this turn begins (the previous
    turn's results collected, steering applied); `attempt`: 1 on the first execution,
    more when the turn is executed again after its executor failed."""

    rt: Runtime
    state: RunState
    turn: int
    attempt: int

    @property
    def run_id(self) -> str:
        return self.state.run_id

    @property
    def first_attempt(self) -> bool:
        return self.attempt == 1

    @cached_property
    def catalog(self) -> list[ToolSpec]:
        """The tools the fleet offers this run, read once for the turn."""
        presences = online_machines(self.rt.redis, self.rt.keys)
        return fleet_catalog(presences, tools.SPECS, self.state.request.machine)
