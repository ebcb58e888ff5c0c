"""2. Fan-out efficiency: one turn of 8 `sleep 1` shell calls over 2 machines.

wall = from the model's reply being fully sent (fake server) to the next model request
arriving: routing, dispatch, 8 real `execute_command` processes (4 per machine, in
parallel), the barrier and the next turn. Ideal is 1 s; target wall / 1 s < 1.10.
"""

from __future__ import annotations

import statistics

from bench.common import Result, Stack, check, requests_for, spread, text, tool_use

NAME = "fanout"
TARGET = 1.10


def one_turn(st: Stack, command: str) -> tuple[float, float]:
    """(loop wall ms, longest tool duration ms) of one turn of 8 calls of `command`."""
    calls = spread(
        st.machines, 8, lambda m: tool_use("execute_command", machine=m, command=command)
    )
    prompt = st.script([calls, text("done")])
    run = st.client.submit(prompt=prompt, timeout_s=60)
    run.wait(timeout=60)
    recs = requests_for(st.fake, prompt)
    if len(recs) != 2:
        raise RuntimeError(f"expected 2 model requests, saw {len(recs)}")
    ends = [e for e in st.events(run.run_id) if e.type == "TOOL_END"]
    if any(e.data["is_error"] for e in ends):
        raise RuntimeError(f"a tool failed: {[e.data for e in ends if e.data['is_error']]}")
    longest = max(e.data["duration_ms"] for e in ends)
    return recs[1]["received_ms"] - recs[0]["sent_ms"], float(longest)


def run(quick: bool) -> Result:
    res = Result(NAME)
    repeats = 1 if quick else 3
    with Stack(env={"CMDOP_WORKER_CONCURRENCY": "8"}) as st:
        one_turn(st, "true")  # warm-up
        samples = [one_turn(st, "sleep 1") for _ in range(repeats)]
    walls = [wall for wall, _ in samples]
    ratio = statistics.median(walls) / 1000
    res.raw = {"walls_ms": walls, "longest_tool_ms": [t for _, t in samples]}
    res.add(
        "8 x `sleep 1` over 2 machines: loop wall / 1 s",
        ratio,
        "x",
        f"median of {repeats}, worst {max(walls) / 1000:.2f}; longest tool"
        f" {statistics.median(t for _, t in samples):.0f} ms; target < {TARGET:.2f}",
        check(ratio, TARGET),
    )
    return res
