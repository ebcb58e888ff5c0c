"""A child run's share of its parent's limits, and whether it may start at all.

Pure decisions for `ask_machine(s)` (`coordinator/local_tools.py`): the turns, tokens
and dollars each child of one call gets from what its parent has left, and why a child
on a host cannot start (nesting too deep, host offline, no dollars left).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class ChildLimits:
    """The turn, token and dollar limits each child run of one ask starts with."""

    max_turns: int
    token_budget: int
    budget_usd: float | None = None


def child_limits(
    *,
    parent_max_turns: int,
    parent_turn: int,
    parent_token_budget: int,
    parent_tokens_used: int,
    children: int,
    own_max_turns: int,
    own_token_budget: int,
) -> ChildLimits:
    """A child's share of what its parent has left; its own defaults when smaller.

    The parent, on `parent_turn`, has `parent_max_turns - parent_turn` turns left (at
    least 1): each child may take as many. Its tokens left are split evenly between
    the `children` one call starts, each getting at least 1.
    """
    turns_left = max(1, parent_max_turns - parent_turn)
    tokens_left = (parent_token_budget - parent_tokens_used) // max(1, children)
    return ChildLimits(
        max_turns=max(1, min(turns_left, own_max_turns)),
        token_budget=max(1, min(tokens_left, own_token_budget)),
    )


BUDGET_SPENT = "the run's budget_usd is spent: no child run may start"


def child_budget_usd(
    budget_usd: float | None, spent_usd: float | None, children: int
) -> float | None:
    """Each child's share of its parent's dollars left (None: the parent has no budget);
    0 when none are left, or the parent's spend is unknown: then no child may start."""
    if budget_usd is None:
        return None
    if spent_usd is None:
        return 0.0
    return max(0.0, budget_usd - spent_usd) / max(1, children)


def host_problem(host: str, online: Collection[str], depth: int, max_depth: int) -> str | None:
    """Why a child run on `host` at `depth` cannot start, or None when it can."""
    if depth > max_depth:
        return (
            f"nesting limit reached: a run at depth {depth - 1} may not start another "
            f"child run (CMDOP_MAX_RUN_DEPTH={max_depth})"
        )
    if host not in online:
        return f"machine {host} is offline"
    return None
