"""The Redis ACL users of a fleet: what a machine worker may touch, and what not.

A machine worker needs little of Redis: its own queue (and its own unacknowledged
messages), the coordinators' continuation queue (to send the next turn, and a
sequential turn's next call when it is another machine's: a coordinator sends it
on), the state of the calls it runs (their start, their outcome, their TOOL_START and
TOOL_END events, parking a call for a person) and its presence. `machine_rules` grants exactly that,
with Redis 7's read (`%R~`) and write (`%W~`) key permissions, so credentials taken
from a machine cannot:

- approve a parked call: verdicts live outside `run:` (`Keys.verdict`), readable only,
  and only those of calls sent to this machine;
- change what a person is asked about another machine's call: parked records are named
  by the call's machine (`Keys.approval`), and a machine writes its own only (a record
  it files for another machine's call id is not taken for that call: `parked_index`);
- make another machine run anything: a machine runs only a message that matches its
  sender's record (`Keys.sent`, `state.sent`), which only the control plane writes
  (a machine reads its own machine's records);
- touch another machine's queue at all, or read its in-flight calls: each machine
  keeps its unacknowledged messages under keys of its own (`machine_broker_options`);
- read a run's prompts, history or result, or cancel it: `state`, `result`,
  `thread:*`, `steer` and `cancel` are out of reach (cancel keys are read-only; a
  control message alone cancels nothing, `state.cancel`); events are write-only, the
  stream and the live channel alike: it publishes, and may subscribe to nothing but
  the runs' cancel notices;
- list keys, flush, reconfigure the server, or talk to Celery's remote control
  (machine workers do not take remote control commands).

What it still can, because a machine genuinely needs it (each key pattern anchored on
its last part, so it names nothing else): write any run's turn results (it cannot read
them), mark calls started, write events into any run's stream (it cannot read them; an
answer given with the APPROVAL_REQUEST it showed is refused unless the call's record
asks the same, `Client.approve(shown=...)`), move watchdog entries in `deadlines` (no
handler takes a score for proof: each checks the stored deadline, expiry, first miss
or turn lock before it acts, `coordinator.watchdog`), add to a run's index of parked
calls (it only says where to look), read a sequential turn's queued calls
(`turn:*:calls`; a fan-out's batches live under `turn:*:current` and `turn:*:queue`
names too), and push messages onto the coordinators' continuation
queue `cmdop.coordinator.next` (it cannot read them; a coordinator runs only the
continuations `cmdop.turn`, `cmdop.hand_on` and `cmdop.local_tool` that arrive there,
`arrival`, and a `cmdop.hand_on` makes it send only a call it stored, of a sequential
turn or of a fan-out's batch out, never one that started). It cannot push onto
`cmdop.coordinator`, so it starts no run. A coordinator, a gateway or a CLI user gets
`coordinator_rules`: all of it.

Pure: builds the rules as argument lists for `ACL SETUSER`; `cmdop-worker acl` prints
them, tests apply them to a real server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from cmdop_worker.state.keys import CONTINUATION_QUEUE, Keys, machine_queue

Access = Literal["R", "W", "RW"]

# Commands: all that touch data (which keys and channels, the key permissions say),
# none that administer the server, list the keyspace or the channels, or load code
# that outlives a call (Redis functions; a script runs as this user, key checks and
# all).
_MACHINE_COMMANDS = (
    "+@all",
    "-@admin",
    "-@dangerous",
    "-scan",
    "-randomkey",
    "-pubsub",
    "-function",
    "-fcall",
    "-fcall_ro",
    "-script|flush",
    "-script|kill",
    "-script|debug",
)


def machine_unacked_keys(machine: str) -> dict[str, str]:
    """kombu's keys for the messages a machine holds unacknowledged: its own, so no
    other machine can read its in-flight calls (kombu's default keys are shared)."""
    queue = machine_queue(machine)
    return {
        "unacked_key": f"unacked:{queue}",
        "unacked_index_key": f"unacked_index:{queue}",
        "unacked_mutex_key": f"unacked_mutex:{queue}",
    }


def machine_key_grants(
    machine: str, *, keys: Keys | None = None, broker_prefix: str = ""
) -> list[tuple[Access, str]]:
    """Each key pattern a machine worker touches, with what it may do there."""
    keys = keys or Keys()
    p, b = keys.prefix, broker_prefix
    queue = machine_queue(machine)
    run = f"{p}run:*"
    return [
        # the broker: its own queue and unacknowledged messages; the coordinators'
        # continuation queue write-only; not `cmdop.coordinator`; no other machine's
        ("RW", f"{b}{queue}"),
        *(("RW", f"{b}{key}") for key in machine_unacked_keys(machine).values()),
        ("W", f"{b}{CONTINUATION_QUEUE}"),
        ("R", f"{b}_kombu.binding.*"),
        ("RW", f"{b}_kombu.binding.{queue}"),
        ("W", f"{b}_kombu.binding_permanent.{queue}"),
        # run state: the calls it runs
        ("R", f"{run}:cancel"),
        ("W", f"{run}:events"),
        ("RW", f"{run}:seq"),
        ("R", f"{run}:terminal"),
        ("W", f"{run}:turn:*:results"),
        ("R", f"{run}:turn:*:expected"),
        ("W", f"{run}:turn:*:advanced"),
        ("RW", f"{run}:turn:*:current"),
        ("RW", f"{run}:turn:*:queue"),
        ("R", f"{run}:turn:*:calls"),
        ("RW", f"{run}:tool:*:started"),
        ("RW", keys.approvals_of(machine)),
        ("W", f"{run}:parked"),
        ("R", keys.verdicts_of(machine)),
        ("R", keys.sent_of(machine)),
        ("W", f"{p}deadlines"),
        # presence: its own key (read at start: is the name held by a live worker?),
        # its name, lapse and last-seen times, the fleet's version (moved on when it
        # joins or leaves; a version tells nothing of any run) and the change log
        # (names and versions; trimming it reads its horizon)
        ("RW", keys.machine(machine)),
        ("W", keys.machines_index),
        ("W", keys.machines_alive),
        ("W", keys.machines_seen),
        ("RW", keys.machines_version),
        ("W", keys.machines_changed),
        ("RW", keys.machines_changed_since),
    ]


def machine_rules(
    machine: str, password: str, *, keys: Keys | None = None, broker_prefix: str = ""
) -> list[str]:
    """`ACL SETUSER <name>` arguments for the machine worker `machine`."""
    keys = keys or Keys()
    grants = machine_key_grants(machine, keys=keys, broker_prefix=broker_prefix)
    # Redis checks a script's declared keys as read and written, whatever the script
    # does with them: a selector lets EVAL/EVALSHA name them all. Each command inside
    # the script is then checked as it runs, against the grants above (the selector
    # allows no command but the call itself), so a script reads no key the machine may
    # only write, and writes none it may only read.
    # (The live channel is among an event's script keys, as a name: never a key here.)
    declared = [*(pattern for _, pattern in grants), f"{keys.prefix}run:*:live"]
    scripts = "(" + " ".join(["+eval", "+evalsha", *(f"~{pattern}" for pattern in declared)])
    return [
        "reset",
        "on",
        f">{password}",
        "resetchannels",
        *_MACHINE_COMMANDS,
        # Channels: publish only. Redis checks a channel the same way for PUBLISH and
        # SUBSCRIBE, and lets a PSUBSCRIBE through whose pattern is a granted one, so
        # with subscribing allowed, `PSUBSCRIBE <p>run:*:live` heard every run's events
        # (model text, every machine's tool inputs and outputs) and Celery's task events.
        "-subscribe",
        "-psubscribe",
        "-ssubscribe",
        *(f"%{access}~{pattern}" for access, pattern in grants),
        f"&{keys.prefix}run:*:live",
        # Celery's worker events (heartbeats; task events when turned on) for monitors
        f"&{broker_prefix}/*.celeryev/*",
        scripts + ")",
        # ... and one thing to listen to: the runs' cancel notices (the cancel hub).
        f"(+psubscribe +subscribe &{keys.control_pattern})",
    ]


def coordinator_rules(password: str) -> list[str]:
    """`ACL SETUSER <name>` arguments for a coordinator, gateway or CLI user: the
    control plane itself, with every key, channel and command."""
    return ["reset", "on", f">{password}", "~*", "&*", "+@all"]


def setuser_line(user: str, rules: Sequence[str]) -> str:
    """One `ACL SETUSER` command, as `redis-cli` reads it (arguments quoted)."""
    return " ".join(["ACL", "SETUSER", _quoted(user), *(_quoted(rule) for rule in rules)])


def _quoted(word: str) -> str:
    if word and all(c.isalnum() or c in "%~&*+-:._|>@!=/<" for c in word):
        return word
    escaped = word.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
