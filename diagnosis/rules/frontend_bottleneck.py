"""frontend_bottleneck: the API server's CPU is the bottleneck (tokenization, detokenization, JSON, HTTP):
requests wait in the front end before they reach the core's queue, and its event loop runs late.

Evidence: the front end's part of TTFT (`requests.frontend_s`: HTTP receipt to the core's queue) up and
explaining most of the TTFT change, the event loop's lag up, the core idle between steps while requests
wait in front of it; at flat arrivals (look-alike queueing_overload), or with the front end's time
explaining nearly all of the TTFT change: arrivals are stamped when the front end takes a request, and a
front end short of CPU takes them late and in bunches, so the rate it records can rise at unchanged demand,
while more demand on a front end with CPU to spare waits in the core's queue, not in front of it.
Look-alike rpc_overhead: the channel's per-token delay grows while the time before the core's queue does
not (a busy loop also delays the outputs it reads, so the RPC delay may grow too: which part explains the
TTFT change decides).
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import arrivals_rose, frontend_grew, make_finding, strength

CAUSE = "frontend_bottleneck"
LEVER = (
    "Give the API server more CPU: more front-end processes (API server scale-out), a faster (Rust) "
    "tokenizer or tokenization off the event loop, smaller payloads (token ids, no logprobs); check the "
    "front end's event-loop lag and CPU."
)


def frontend_share(facts: Facts) -> float:
    """The front end's part of the mean TTFT change (NaN when TTFT did not grow)."""
    fb, fc = facts.req_pair("frontend_mean")
    tb, tc = facts.req_pair("ttft_mean")
    if not (math.isfinite(fb) and math.isfinite(fc)) or not tc > tb:
        return math.nan
    return min(1.0, (fc - fb) / (tc - tb))


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """Mean front-end time up by `frontend_ratio` and `min_frontend_increase_s`, arrivals not risen
    (`arrivals_rose`) unless the front end explains `frontend_over_arrivals_share` of the mean TTFT
    change. Share = the front end's part of the mean TTFT change."""
    cfg = facts.config
    if not (facts.req_baseline("with_frontend") > 0 and facts.req_current("with_frontend") > 0):
        return NotEnoughData(CAUSE, "stepscope.latency.frontend_s on llm_request (the front end's part)")
    symptoms = facts.regressed("ttft", "e2e", "goodput", "throughput")
    fb, fc = facts.req_pair("frontend_mean")
    if not symptoms or not frontend_grew(facts):
        return None
    share = frontend_share(facts)
    if arrivals_rose(facts) and not share >= cfg.frontend_over_arrivals_share:
        return None
    evidence = [
        Evidence("frontend_s_mean", fb, fc),
        Evidence("frontend_share_of_ttft_change", 0.0, share),
        Evidence("event_loop_lag_s_mean", *facts.req_pair("loop_lag_mean")),
        Evidence("ttft_s_mean", *facts.req_pair("ttft_mean")),
        Evidence("queue_s_mean", *facts.req_pair("queue_mean")),
        Evidence("arrival_rate_rps", *facts.req_pair("rate_rps")),
        Evidence("rpc_delay_s_mean", *facts.req_pair("rpc_delay_mean")),
    ]
    idle = facts.decomposition.get("throughput", {})
    if "idle_share" in idle.get("current", {}):
        evidence.append(
            Evidence("core_idle_share", idle["baseline"]["idle_share"], idle["current"]["idle_share"])
        )
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(fc / fb if fb > 0 else math.inf, cfg.frontend_ratio),
        # the front end's own cost per request (its fastest requests wait for nothing) steps up at the
        # onset; the mean, made of waiting, grows as the backlog builds
        onset_series="frontend_p10",
        evidence=evidence,
        lever=LEVER,
        summary=f"the front end holds a request {fb * 1e3:.1f} -> {fc * 1e3:.1f} ms before the core's queue",
    )
