"""The Redis ACL users a fleet's operator creates (`state.acl`), as text."""

from __future__ import annotations

import fnmatch
import shlex

from cmdop_worker.state.acl import (
    coordinator_rules,
    machine_key_grants,
    machine_rules,
    machine_unacked_keys,
    setuser_line,
)
from cmdop_worker.state.keys import CONTINUATION_QUEUE, COORDINATOR_QUEUE, Keys, machine_queue

KEYS = Keys()
RUN, TUID = "0123abcd", "toolu_01"


def grants_for(key: str, machine: str = "web") -> set[str]:
    """What the machine's grants allow on `key`: "R", "W", both or neither."""
    found: set[str] = set()
    for access, pattern in machine_key_grants(machine):
        if fnmatch.fnmatchcase(key, pattern):
            found.update(access)
    return found


def test_a_machine_cannot_write_verdicts_nor_touch_run_state_cancels_or_results() -> None:
    assert grants_for(KEYS.verdict(RUN, TUID, "web")) == {"R"}
    assert grants_for(KEYS.cancel(RUN)) == {"R"}
    for key in (KEYS.state(RUN), KEYS.result(RUN), KEYS.steer(RUN), KEYS.thread("t", "history")):
        assert grants_for(key) == set(), key


def test_a_machine_writes_parked_records_of_its_own_calls_only() -> None:
    assert grants_for(KEYS.approval(RUN, TUID, "web")) == {"R", "W"}
    for other in ("db", "web2", "we"):  # a name it prefixes, or that prefixes it
        assert grants_for(KEYS.approval(RUN, TUID, other)) == set(), other
        assert grants_for(KEYS.verdict(RUN, TUID, other)) == set(), other


def test_a_machine_writes_outcomes_and_events_it_cannot_read() -> None:
    assert grants_for(KEYS.turn(RUN, 3, "results")) == {"W"}
    assert grants_for(KEYS.events(RUN)) == {"W"}


def test_a_machine_touches_only_its_own_queue_and_in_flight_messages() -> None:
    assert grants_for(machine_queue("web")) == {"R", "W"}
    assert grants_for(machine_queue("db")) == set()  # another's call goes by a coordinator
    assert grants_for(machine_queue("web2")) == set()  # a name it prefixes is another's
    assert grants_for(CONTINUATION_QUEUE) == {"W"}
    assert grants_for(COORDINATOR_QUEUE) == set()  # where runs start
    for key in machine_unacked_keys("web").values():
        assert grants_for(key) == {"R", "W"}
    for key in [*machine_unacked_keys("db").values(), "unacked", "unacked_index"]:
        assert grants_for(key) == set(), key


def test_a_machine_reads_the_records_of_calls_sent_to_it_and_writes_none() -> None:
    assert grants_for(KEYS.sent(RUN, TUID, "web")) == {"R"}
    for other in ("db", "web2", "we"):
        assert grants_for(KEYS.sent(RUN, TUID, other)) == set(), other


def test_every_grant_sits_under_the_configured_prefixes() -> None:
    grants = machine_key_grants("web", keys=Keys("t1:"), broker_prefix="b1:")
    assert all(p.startswith(("t1:", "b1:")) for _, p in grants)


def test_the_printed_line_reads_back_as_the_rules() -> None:
    rules = machine_rules("web", "pw with spaces")
    words = shlex.split(setuser_line("cmdop-machine-web", rules))
    assert words[:3] == ["ACL", "SETUSER", "cmdop-machine-web"]
    assert words[3:] == rules
    scripts, listening = rules[-2:]
    assert scripts.startswith("(+eval +evalsha ~") and scripts.endswith(")")
    assert listening == "(+psubscribe +subscribe &cmdop:run:*:control)"


def test_the_coordinators_user_holds_everything() -> None:
    assert coordinator_rules("pw") == ["reset", "on", ">pw", "~*", "&*", "+@all"]


def test_a_machine_under_its_own_user_takes_no_remote_control() -> None:
    from cmdop_worker.celery_app import takes_remote_control
    from cmdop_worker.config import Settings

    named = "redis://cmdop-machine-web:pw@redis:6379/0"
    assert not takes_remote_control(Settings(machine="web", redis_url=named))
    assert takes_remote_control(Settings(machine="web", redis_url="redis://:pw@redis:6379/0"))
    assert takes_remote_control(Settings(redis_url=named))  # a coordinator
