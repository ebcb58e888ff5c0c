"""Every Redis key, channel and queue name the fleet uses, in one place.

Key schema (prefix `cmdop:` by default, `CMDOP_KEY_PREFIX` changes it):

    <p>run:<id>:state              string   RunState JSON (internal)
    <p>run:<id>:events             stream   one entry per event, field `event` (contract)
    <p>run:<id>:live               channel  the same event JSON, live (contract)
    <p>run:<id>:seq                string   last event seq (internal)
    <p>run:<id>:terminal           string   set once the terminal event is written (internal)
    <p>run:<id>:cancel             string   CancelRequest JSON (contract)
    <p>run:<id>:control            channel  CancelRequest JSON, pushed (contract)
    <p>run:<id>:result             string   RunResult JSON (contract)
    <p>run:<id>:turn:<n>:results   hash     tool_use_id -> ToolOutcome JSON (internal)
    <p>run:<id>:turn:<n>:expected  string   how many results turn n waits for (internal)
    <p>run:<id>:turn:<n>:advanced  string   set by whoever advances past turn n (internal)
    <p>run:<id>:turn:<n>:lock      string   lease of the task executing turn n, renewed (internal)
    <p>run:<id>:turn:<n>:calls     hash     a sequential turn's calls: tuid -> QueuedCall JSON
    <p>run:<id>:turn:<n>:queue     list     its calls still to come, in order (internal)
    <p>run:<id>:turn:<n>:current   string   its call out now (internal; see `barrier`)
    <p>run:<id>:tool:<tuid>:started string  set when a machine (or, for an ask, the
                                            coordinator) starts a call (internal)
    <p>parked:<machine>:<id>:<tuid> hash    a parked call: an "ask" waiting for a person, as
                                            its machine parked it, and whether that machine
                                            acted on the answer. Named by the machine the
                                            call was sent to, first: a machine's ACL writes
                                            its own machine's records only, so no machine
                                            changes what a person is asked about another's
                                            call (internal; see `approvals`)
    <p>verdict:<machine>:<id>:<tuid> hash   the answer to a parked call (state, answer, the
                                            call as answered), written by answerers only:
                                            a machine's ACL reads its own machine's and
                                            writes none (internal; see `approvals`)
    <p>sent:<machine>:<id>:<tuid>  string   the digest of a call as it was sent to its machine
                                            (`sent.call_digest`), written by senders only: a
                                            machine runs a call only if its message matches;
                                            its ACL reads its own machine's, writes none
                                            (internal; see `sent`)
    <p>run:<id>:parked             set      "<machine>:<tuid>" of each call the run has
                                            parked: where to find its record (internal)
    <p>run:<id>:steer              list     messages steering the run, in order (internal)
    <p>run:<id>:start              string   a client's start request until a coordinator
                                            handled it, and when it was sent (internal;
                                            see `starts`)
    <p>thread:<id>:history         string   the messages its last run ended with (internal)
    <p>thread:<id>:runs            list     the thread's run ids, oldest first (internal)
    <p>thread:<id>:active          string   "<run id> <claimed ms>": the run it serves (internal)
    <p>thread:<id>:queue           list     request JSONs waiting for the thread (internal)
    <p>threads                     zset     thread ids, score = last used (ms) (internal)
    <p>run:<id>:children           set      child runs started by ask_machine(s) (internal)
    <p>run:<id>:ask:<tuid>:*       various  a fan-out's hosts and answers (internal)
    <p>deadlines                   zset     watchdog entries, score = due time in ms; members
                                            turn:<id>:<n>, run:<id>, cancel:<id>,
                                            advance:<id>:<n>, probe:<id>:<n>,
                                            approval:<id>:<tuid>, start:<id>
                                            (internal; see watchdog)
    <p>run:<id>:missing:<machine>  string   a machine seen gone by a probe (internal)
    <p>machine:<name>              string   MachinePresence JSON with a short TTL (contract)
    <p>machines                    set      names of machines with a presence key (internal)
    <p>machines:version            string   the fleet's version: moves on when a machine
                                            joins, leaves or changes what it offers; readers
                                            keep presences by it (internal; see `presence`)
    <p>machines:alive              zset     machine names, score = when (Redis time, ms) its
                                            presence lapses unless renewed (internal)
    <p>machines:seen               zset     every machine name the fleet has seen, score =
                                            when (Redis time, ms) it was last seen: when it
                                            announced itself, left, or its presence lapsed;
                                            never expires (internal; see `presence`)
    <p>machines:changed            zset     the machines each change of the version touched
                                            (joined, left, changed, forgotten), score = the
                                            version it moved to; trimmed by age (internal)
    <p>machines:changed:since      string   the version after which `machines:changed` holds
                                            every change (internal; see `presence`)
    <p>coordinator:<host>:<pid>    string   a live coordinator's watchdog, short TTL (internal)
    <p>ratelimit:<account>:<model> hash     the fleet's rate limiter for one API key (a hash of
                                            endpoint and key, never the key) and model:
                                            per dimension r/i/o `cap`, `t`, `tat`; `pause`,
                                            `epoch`, `probe`, `bare`; expires when idle
                                            (internal; see `ratelimit`)

Pure: builds strings, touches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

COORDINATOR_QUEUE = "cmdop.coordinator"
# Where machine workers send a run's continuations (`arrival.CONTINUATIONS`), and only
# there: coordinators consume both queues, and run nothing else that arrives here.
CONTINUATION_QUEUE = "cmdop.coordinator.next"
MACHINE_QUEUE_PREFIX = "cmdop.machine."


def machine_queue(machine: str) -> str:
    return f"{MACHINE_QUEUE_PREFIX}{machine}"


# Members of the watchdog's sorted set (`Keys.deadlines`); see `watchdog`.


def turn_member(run_id: str, turn: int) -> str:
    """The watchdog entry of turn n's deadline."""
    return f"turn:{run_id}:{turn}"


def run_member(run_id: str) -> str:
    """The watchdog entry of a run's deadline."""
    return f"run:{run_id}"


def cancel_member(run_id: str) -> str:
    """The watchdog entry that applies a cancel request if no listener did."""
    return f"cancel:{run_id}"


def advance_member(run_id: str, turn: int) -> str:
    """The watchdog entry that sees turn `turn` of a run started and carried out."""
    return f"advance:{run_id}:{turn}"


def probe_member(run_id: str, turn: int) -> str:
    """The watchdog entry that checks the machines of turn n's pending calls."""
    return f"probe:{run_id}:{turn}"


def parked_member(machine: str, tool_use_id: str) -> str:
    """A call in its run's index of parked calls (`Keys.parked`): where its record is."""
    return f"{machine}:{tool_use_id}"


def start_member(run_id: str) -> str:
    """The watchdog entry that sends a client's start again if no coordinator took it."""
    return f"start:{run_id}"


def approval_member(run_id: str, tool_use_id: str) -> str:
    """The watchdog entry that expires a parked call nobody answered in time."""
    return f"approval:{run_id}:{tool_use_id}"


@dataclass(frozen=True)
class Keys:
    prefix: str = "cmdop:"

    def run(self, run_id: str, part: str) -> str:
        return f"{self.prefix}run:{run_id}:{part}"

    def state(self, run_id: str) -> str:
        return self.run(run_id, "state")

    def start(self, run_id: str) -> str:
        return self.run(run_id, "start")

    def events(self, run_id: str) -> str:
        return self.run(run_id, "events")

    def live(self, run_id: str) -> str:
        return self.run(run_id, "live")

    def seq(self, run_id: str) -> str:
        return self.run(run_id, "seq")

    def terminal(self, run_id: str) -> str:
        return self.run(run_id, "terminal")

    def cancel(self, run_id: str) -> str:
        return self.run(run_id, "cancel")

    def control(self, run_id: str) -> str:
        return self.run(run_id, "control")

    @property
    def control_pattern(self) -> str:
        return f"{self.prefix}run:*:control"

    def run_id_from_control(self, channel: str) -> str:
        return channel[len(self.prefix) + len("run:") : -len(":control")]

    def result(self, run_id: str) -> str:
        return self.run(run_id, "result")

    def turn(self, run_id: str, turn: int, part: str) -> str:
        return self.run(run_id, f"turn:{turn}:{part}")

    def ask(self, run_id: str, tool_use_id: str, part: str) -> str:
        """A fan-out's `hosts` (JSON list, in call order) and `answers` (hash)."""
        return self.run(run_id, f"ask:{tool_use_id}:{part}")

    def tool_started(self, run_id: str, tool_use_id: str) -> str:
        return self.run(run_id, f"tool:{tool_use_id}:started")

    def approval(self, run_id: str, tool_use_id: str, machine: str) -> str:
        """The parked record of a call that waits for a person's answer, under the
        name of the machine the call was sent to (machine names hold no `:` or glob
        character, so `parked:<machine>:*` names that machine's records alone)."""
        return f"{self.prefix}parked:{machine}:{run_id}:{tool_use_id}"

    def approvals_of(self, machine: str) -> str:
        """The pattern of every parked record of one machine (its ACL grant)."""
        return f"{self.prefix}parked:{machine}:*"

    def verdict(self, run_id: str, tool_use_id: str, machine: str) -> str:
        """The answer to a parked call: apart from its record, which machines write."""
        return f"{self.prefix}verdict:{machine}:{run_id}:{tool_use_id}"

    def verdicts_of(self, machine: str) -> str:
        """The pattern of every verdict on one machine's calls (its ACL grant)."""
        return f"{self.prefix}verdict:{machine}:*"

    def sent(self, run_id: str, tool_use_id: str, machine: str) -> str:
        """What a call was sent to its machine as: written by its sender, never by a
        machine (so no machine's credentials make another machine run a call)."""
        return f"{self.prefix}sent:{machine}:{run_id}:{tool_use_id}"

    def sent_of(self, machine: str) -> str:
        """The pattern of every call sent to one machine (its ACL grant, read-only)."""
        return f"{self.prefix}sent:{machine}:*"

    def parked(self, run_id: str) -> str:
        """The run's parked calls, as `parked_member`s (a cancel answers those waiting)."""
        return self.run(run_id, "parked")

    def steer(self, run_id: str) -> str:
        return self.run(run_id, "steer")

    def thread(self, thread_id: str, part: str) -> str:
        """A thread's `history`, `runs`, `active` or `queue`; all expire together."""
        return f"{self.prefix}thread:{thread_id}:{part}"

    @property
    def threads_index(self) -> str:
        return f"{self.prefix}threads"

    @property
    def deadlines(self) -> str:
        return f"{self.prefix}deadlines"

    def machine(self, machine: str) -> str:
        return f"{self.prefix}machine:{machine}"

    @property
    def machines_index(self) -> str:
        return f"{self.prefix}machines"

    @property
    def machines_version(self) -> str:
        return f"{self.prefix}machines:version"

    @property
    def machines_alive(self) -> str:
        return f"{self.prefix}machines:alive"

    @property
    def machines_seen(self) -> str:
        return f"{self.prefix}machines:seen"

    @property
    def machines_changed(self) -> str:
        return f"{self.prefix}machines:changed"

    @property
    def machines_changed_since(self) -> str:
        return f"{self.prefix}machines:changed:since"

    def coordinator(self, name: str) -> str:
        return f"{self.prefix}coordinator:{name}"

    @property
    def coordinator_pattern(self) -> str:
        return f"{self.prefix}coordinator:*"

    def ratelimit(self, scope: str) -> str:
        """The fleet's shared limiter of one scope (`core.ratelimit.limiter_scope`)."""
        return f"{self.prefix}ratelimit:{scope}"

    def run_keys(self, run_id: str) -> list[str]:
        """Keys that expire together once a run has ended."""
        return [
            self.state(run_id),
            self.events(run_id),
            self.seq(run_id),
            self.terminal(run_id),
            self.cancel(run_id),
            self.result(run_id),
        ]
