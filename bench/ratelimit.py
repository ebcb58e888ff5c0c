"""10. The fleet's rate limiter: 429s and the share of the provider's limit used.

The fake model allows 5 requests per second (a bucket of 5, one back every 200 ms) and
answers a 429 with `retry-after` beyond it, sending the `anthropic-ratelimit-*` headers
on every response, as the API does. 4 coordinator processes get 60 one-turn runs at
once (20 with --quick), first with `CMDOP_RATE_LIMITER=on`, then — in the same
invocation, with a fresh Redis and fake — a fleet with it off; the retry settings are
the product's defaults (6 attempts, backoff from 0.5 s).

Reported for each: the 429s the fleet received (the aim: at most one per coordinator
once the limiter has seen a response), runs that ended DONE, and the requests per
second the fake answered with a 200 beyond its initial bucket, (answered - 5) / (last -
first), against the limit of 5/s (aim: at least 90% of it).
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import Result, Stack, check, text

NAME = "ratelimit"
COORDINATORS = 4
LIMIT_PER_S = 5


def one_fleet(limiter: str, runs: int) -> dict[str, Any]:
    env = {"CMDOP_RATE_LIMITER": limiter}
    with Stack(machines=(), coordinators=COORDINATORS, env=env) as st:
        st.fake.set_rate_limit(requests=LIMIT_PER_S, window_s=1)
        prompt = st.script([text("fine")])
        started = time.monotonic()
        submitted = [st.client.submit(prompt=f"{prompt} {i}", timeout_s=600) for i in range(runs)]
        results = [r.wait(timeout=660, raise_on_failure=False) for r in submitted]
        seconds = time.monotonic() - started
        answered = [_status(rec) for rec in st.fake.requests()]
        ok_ms = sorted(rec["received_ms"] for rec in st.fake.requests() if _status(rec) == 200)
    span_s = (ok_ms[-1] - ok_ms[0]) / 1000 if len(ok_ms) > 1 else float("nan")
    return {
        "limiter": limiter,
        "runs": runs,
        "done": sum(r.status == "done" for r in results),
        "errors": sorted({r.error.kind for r in results if r.error is not None}),
        "requests": len(answered),
        "answered_200": answered.count(200),
        "answered_429": answered.count(429),
        "sustained_per_s": (len(ok_ms) - LIMIT_PER_S) / span_s if span_s else float("nan"),
        "seconds": seconds,
    }


def _status(rec: dict[str, Any]) -> int:
    fault = (rec.get("response") or {}).get("fault") or {}
    return int(fault.get("status", 200))


def run(quick: bool) -> Result:
    res = Result(NAME)
    runs = 20 if quick else 60
    on, off = one_fleet("on", runs), one_fleet("off", runs)
    res.raw = {"on": on, "off": off, "coordinators": COORDINATORS, "limit_per_s": LIMIT_PER_S}
    per_coordinator = on["answered_429"] / COORDINATORS
    res.add(
        f"429s, limiter on ({on['done']}/{runs} runs DONE)",
        on["answered_429"],
        "429s",
        f"limiter off: {off['answered_429']} ({off['done']}/{runs} DONE)",
        check(per_coordinator, 1.0),
    )
    res.add(
        "429s per coordinator, limiter on",
        per_coordinator,
        "429s",
        "target <= 1",
        check(per_coordinator, 1.0),
    )
    used = on["sustained_per_s"] / LIMIT_PER_S
    res.add(
        "sustained 200s/s, limiter on",
        on["sustained_per_s"],
        "req/s",
        f"limit {LIMIT_PER_S}/s; limiter off {off['sustained_per_s']:.2f}/s",
        f"{used:.0%} of limit" + ("" if used >= 0.9 else " MISS"),
    )
    res.add(
        "wall time for all runs, limiter on",
        on["seconds"],
        "s",
        f"limiter off {off['seconds']:.1f} s",
    )
    return res
