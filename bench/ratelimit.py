"""10. The fleet's rate limiter: 429s and the share of the provider's limit used.

The fake model allows 5 requests per second in two ways, each in its own fleet:

- `bucket`: a bucket of 5, one back every 200 ms (`requests=5, window_s=1`);
- `per-second`: 300 a minute, also enforced per second as the API documents it
  (`requests=300, short_interval_s=1`: at most 5 in any second, though the headers
  state a bucket of 300), `fake_limits`.

Both answer a 429 with `retry-after` beyond the limit and send the
`anthropic-ratelimit-*` headers on every response, as the API does. 4 coordinator
processes get 60 one-turn runs at once (20 with --quick), with `CMDOP_RATE_LIMITER=on`;
then — in the same invocation, with a fresh Redis and fake each — the per-second
limit with the limiter off; the retry settings are the product's defaults (6 attempts,
backoff from 0.5 s).

Reported for each: the 429s the fleet received (the aim: at most one per coordinator),
runs that ended DONE, and the share of the limit used (aim: at least 90%): the 200s
per second the fleet sustained, counted over its busy span (first to last 200) less
its first and last second, against the limit of 5/s. Leaving the edges out counts
neither the initial allowance a bursting client spends at once nor the one a pacing
client never spends; the earlier figure, (answered - 5) / (last - first), which
charges a pacing client for the allowance it left, is reported beside it.
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import Result, Stack, check, text

NAME = "ratelimit"
COORDINATORS = 4
LIMIT_PER_S = 5
LIMITS: dict[str, dict[str, float]] = {
    "bucket": {"requests": LIMIT_PER_S, "window_s": 1},
    "per-second": {"requests": LIMIT_PER_S * 60, "short_interval_s": 1},
}


def one_fleet(limiter: str, limit: str, runs: int) -> dict[str, Any]:
    env = {"CMDOP_RATE_LIMITER": limiter}
    with Stack(machines=(), coordinators=COORDINATORS, env=env) as st:
        st.fake.set_rate_limit(**LIMITS[limit])
        prompt = st.script([text("fine")])
        started = time.monotonic()
        submitted = [st.client.submit(prompt=f"{prompt} {i}", timeout_s=600) for i in range(runs)]
        results = [r.wait(timeout=660, raise_on_failure=False) for r in submitted]
        seconds = time.monotonic() - started
        answered = [_status(rec) for rec in st.fake.requests()]
        ok_ms = sorted(rec["received_ms"] for rec in st.fake.requests() if _status(rec) == 200)
    span_s = (ok_ms[-1] - ok_ms[0]) / 1000 if len(ok_ms) > 1 else float("nan")
    middle = [at for at in ok_ms if ok_ms[0] + 1000 <= at <= ok_ms[-1] - 1000]
    return {
        "limiter": limiter,
        "limit": limit,
        "runs": runs,
        "done": sum(r.status == "done" for r in results),
        "errors": sorted({r.error.kind for r in results if r.error is not None}),
        "requests": len(answered),
        "answered_200": answered.count(200),
        "answered_429": answered.count(429),
        "sustained_per_s": len(middle) / (span_s - 2) if span_s > 2 else float("nan"),
        "beyond_allowance_per_s": (len(ok_ms) - LIMIT_PER_S) / span_s if span_s else float("nan"),
        "seconds": seconds,
    }


def _status(rec: dict[str, Any]) -> int:
    fault = (rec.get("response") or {}).get("fault") or {}
    return int(fault.get("status", 200))


def _rows(res: Result, fleet: dict[str, Any], off: dict[str, Any] | None) -> None:
    runs, limit = fleet["runs"], fleet["limit"]
    per_coordinator = fleet["answered_429"] / COORDINATORS
    beside = f"limiter off: {off['answered_429']} ({off['done']}/{runs} DONE)" if off else ""
    res.add(
        f"{limit}: 429s, limiter on ({fleet['done']}/{runs} runs DONE)",
        fleet["answered_429"],
        "429s",
        beside,
        check(per_coordinator, 1.0),
    )
    used = fleet["sustained_per_s"] / LIMIT_PER_S
    old = fleet["beyond_allowance_per_s"] / LIMIT_PER_S
    off_rate = f"; limiter off {off['sustained_per_s']:.2f}/s" if off else ""
    res.add(
        f"{limit}: sustained 200s/s, limiter on",
        fleet["sustained_per_s"],
        "req/s",
        f"limit {LIMIT_PER_S}/s{off_rate}; beyond the allowance {old:.0%}",
        f"{used:.0%} of limit" + ("" if used >= 0.9 else " MISS"),
    )
    res.add(f"{limit}: wall time for all runs, limiter on", fleet["seconds"], "s")


def run(quick: bool) -> Result:
    res = Result(NAME)
    runs = 20 if quick else 60
    bucket = one_fleet("on", "bucket", runs)
    per_second = one_fleet("on", "per-second", runs)
    off = one_fleet("off", "per-second", runs)
    res.raw = {
        "bucket": bucket,
        "per_second": per_second,
        "per_second_off": off,
        "coordinators": COORDINATORS,
        "limit_per_s": LIMIT_PER_S,
    }
    _rows(res, bucket, None)
    _rows(res, per_second, off)
    return res
