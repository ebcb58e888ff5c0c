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
    <p>run:<id>:tool:<tuid>:started string  set when a machine starts a call (internal)
    <p>run:<id>:approval:<tuid>    list     an approval answer for an "ask" (internal)
    <p>run:<id>:children           set      child runs started by ask_machine(s) (internal)
    <p>run:<id>:ask:<tuid>:*       various  a fan-out's hosts and answers (internal)
    <p>deadlines                   zset     watchdog entries, score = due time in ms; members
                                            turn:<id>:<n>, run:<id>, cancel:<id>,
                                            advance:<id>:<n>, probe:<id>:<n>
                                            (internal; see watchdog)
    <p>run:<id>:missing:<machine>  string   a machine seen gone by a probe (internal)
    <p>machine:<name>              string   MachinePresence JSON with a short TTL (contract)
    <p>machines                    set      names of machines with a presence key (internal)
    <p>coordinator:<host>:<pid>    string   a live coordinator's watchdog, short TTL (internal)

Pure: builds strings, touches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

COORDINATOR_QUEUE = "cmdop.coordinator"
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


@dataclass(frozen=True)
class Keys:
    prefix: str = "cmdop:"

    def run(self, run_id: str, part: str) -> str:
        return f"{self.prefix}run:{run_id}:{part}"

    def state(self, run_id: str) -> str:
        return self.run(run_id, "state")

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

    def approval(self, run_id: str, tool_use_id: str) -> str:
        return self.run(run_id, f"approval:{tool_use_id}")

    @property
    def deadlines(self) -> str:
        return f"{self.prefix}deadlines"

    def machine(self, machine: str) -> str:
        return f"{self.prefix}machine:{machine}"

    @property
    def machines_index(self) -> str:
        return f"{self.prefix}machines"

    def coordinator(self, name: str) -> str:
        return f"{self.prefix}coordinator:{name}"

    @property
    def coordinator_pattern(self) -> str:
        return f"{self.prefix}coordinator:*"

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
