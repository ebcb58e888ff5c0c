"""What every step of one turn's execution reads: the turn context.

Built once by `coordinator.turn.execute_turn` when it holds the turn's lease, and
passed to each step of the turn (`prepare`, `model_call`, `reply`) in place of the
runtime, run id, turn and attempt each would otherwise take one by one. The fleet's
presence is read at most once per turn (`calls.read_fleet`), when a step first needs
it: the model's tool catalogue and the routing of its calls both use that read (a turn
that ends before its model call reads none). That read is one round trip of O(1)
Redis commands while the fleet is unchanged (`state.presence`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from cmdop_worker.coordinator.calls import FleetView, read_fleet
from cmdop_worker.runtime import Runtime
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
    def fleet(self) -> FleetView:
        """The fleet as this turn reads it, once."""
        return read_fleet(self.rt, self.state)
