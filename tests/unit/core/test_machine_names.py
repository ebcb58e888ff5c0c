"""What the fleet says about a machine name it never saw, or knows but finds offline
(`core.machine_names`), and routing's use of it: a call to a never-seen name is
"unknown machine" (status invalid) with the closest known names, one to a known offline
name "offline" as before."""

from __future__ import annotations

import pytest

from cmdop_worker.core.machine_names import (
    PERSON_HINT,
    ago,
    closest_names,
    name_held,
    offline_warning,
    unknown_machine,
)
from cmdop_worker.core.routing import Refused, RoutingRules, ToMachine, fleet_of, route_call
from cmdop_worker.models import MachinePresence, ToolSpec

SHELL = ToolSpec(name="execute_command", description="Run.", input_schema={"type": "object"})


def test_closest_names_are_the_likeliest_typos_best_first() -> None:
    assert closest_names("alhpa", ["alpha", "beta", "alpine", "zulu"]) == ["alpha", "alpine"]
    assert closest_names("qqqq", ["alpha", "beta"]) == []


@pytest.mark.parametrize(
    ("machine", "known", "online", "said"),
    [
        (
            "alhpa",
            {"alpha", "alpine", "beta"},
            {"alpha"},
            "unknown machine 'alhpa': no machine of that name has ever joined this fleet; "
            "closest known names: alpha, alpine (offline)",
        ),
        (
            "qqqq",
            {"alpha"},
            {"alpha"},
            "unknown machine 'qqqq': no machine of that name has ever joined this fleet; "
            "list_machines lists the machines online",
        ),
        (
            "alpha",
            set(),
            set(),
            "unknown machine 'alpha': no machine of that name has ever joined this fleet; "
            "no machine has joined it yet",
        ),
    ],
)
def test_an_unknown_machine_is_said_with_the_closest_known(machine, known, online, said) -> None:
    assert unknown_machine(machine, known, online) == said


def test_a_person_is_pointed_at_the_cli_not_at_the_models_tool() -> None:
    said = unknown_machine("qqqq", {"alpha"}, set(), hint=PERSON_HINT)
    assert said.endswith("; cmdop-worker machines --all lists every known machine")


@pytest.mark.parametrize(
    ("elapsed_ms", "shown"),
    [(0, "0s"), (59_999, "59s"), (60_000, "1m"), (7_200_000, "2h"), (3 * 86_400_000, "3d")],
)
def test_ago_reads_as_a_person_says_it(elapsed_ms, shown) -> None:
    assert ago(elapsed_ms) == shown


def test_an_offline_warning_says_when_last_seen() -> None:
    assert offline_warning("beta", 1_000, 181_000) == (
        "machine 'beta' is offline (last seen 3m ago); its tool calls fail until it is back"
    )
    assert offline_warning("beta", None, 5).startswith("machine 'beta' is offline; ")


def test_a_held_name_names_its_holder_and_the_ways_on() -> None:
    said = name_held("alpha", "web-7", 4121)
    assert "held by a live worker on host web-7 (pid 4121)" in said
    assert "--take-over" in said and "CMDOP_MACHINE_TAKE_OVER=1" in said


RULES = RoutingRules(
    visible=frozenset({"execute_command"}),
    known=frozenset({"execute_command"}),
    coordinator_tools=frozenset(),
    target_machine=None,
    default_timeout_ms=1_000,
    grace_ms=100,
    run_deadline_ms=10_000,
)


def call(machine: str) -> dict[str, object]:
    return {"id": "t1", "name": "execute_command", "input": {"machine": machine, "command": "x"}}


def test_routing_tells_a_machine_never_seen_from_one_offline() -> None:
    alpha = MachinePresence(machine="alpha", host="h", pid=1, started_ms=0, tools=[SHELL])
    fleet = fleet_of([alpha], known={"beta"})
    assert fleet.known == {"alpha", "beta"}  # online names are known, stamped or not
    typo = route_call(call("alhpa"), RULES, fleet, now_ms=0)
    assert isinstance(typo, Refused) and typo.status == "invalid"
    assert typo.message.startswith("unknown machine 'alhpa': ")
    assert typo.message.endswith("closest known names: alpha")
    gone = route_call(call("beta"), RULES, fleet, now_ms=0)
    assert isinstance(gone, Refused) and gone.status == "offline"
    assert isinstance(route_call(call("alpha"), RULES, fleet, now_ms=0), ToMachine)


def test_routing_without_known_names_answers_offline_as_before() -> None:
    alpha = MachinePresence(machine="alpha", host="h", pid=1, started_ms=0, tools=[SHELL])
    refused = route_call(call("alhpa"), RULES, fleet_of([alpha]), now_ms=0)
    assert isinstance(refused, Refused) and refused.status == "offline"
