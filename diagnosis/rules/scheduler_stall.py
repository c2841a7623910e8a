"""scheduler_stall: the step loop stops between steps while decodes wait (a lock, a GC pause, a blocking
call in the loop).

Evidence: gaps between consecutive decode steps up (look-alike queueing_overload: arrivals up, the loop
busy with steps and no gaps) and the front end's RPC delay unchanged where it is measured (look-alike
rpc_overhead: the delay between a step's end and the front end seeing its tokens is what grew; look-alike
kv_transfer_slow: a disaggregated decode worker waits between its steps for prompts' KV that a slow link
delivers late, so its gaps grow with the transfer's time: 16 -> 31 ms at a link of 10 MB/s in a dev run).
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import (
    channel_dominates,
    gaps_grew,
    kv_transfer_slowed,
    make_finding,
    period_share,
    rpc_grew,
    steps_missing,
    strength,
    with_consequences,
)

CAUSE = "scheduler_stall"
LEVER = (
    "Profile the step loop between steps (py-spy dump, lock contention, GC): move the blocking work "
    "(locks held by other threads, logging, metrics export, tokenization) off the loop."
)


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """Mean gap before decode steps up by `gap_ratio` and `min_gap_increase_s`; RPC delay not grown, or
    grown by less than `rpc_share_of_gap` of the gaps' growth (`channel_dominates`).
    Share = gaps' part of the step-period change; at arrivals that did not rise, with the fuller batch,
    the prefills in decode steps and the queue that follow once the stalls take the engine's capacity
    below the arrivals. Arrivals are reported, not tested: more arrivals do not open gaps between steps
    (`gaps_grew`), and a stall's queue makes the change point land where arrivals happen to bunch."""
    if missing := steps_missing(facts, CAUSE, "gaps between steps"):
        return missing
    symptoms = facts.regressed("tpot", "itl_max", "e2e", "ttft", "throughput", "goodput")
    gb, gc = facts.step_baseline("work_gap_mean"), facts.step_current("work_gap_mean")
    if not symptoms or not gaps_grew(facts) or (rpc_grew(facts) and channel_dominates(facts)):
        return None
    if kv_transfer_slowed(facts) is not None:
        return None  # a decode worker waiting for the KV it reserved blocks for idles between its steps
    share = with_consequences(facts, period_share(facts, "gaps"), ("gaps",), ())
    evidence = [
        Evidence("gap_before_decode_step_s_mean", gb, gc),
        Evidence("gap_before_decode_step_s_p99", *facts.step_pair("work_gap_p99")),
        Evidence("step_s_mean", *facts.step_pair("step_mean")),
        Evidence("arrival_rate_rps", *facts.req_pair("rate_rps")),
    ]
    if rpc_grew(facts) is not None:
        evidence.append(Evidence("rpc_delay_s_mean", *facts.req_pair("rpc_delay_mean")))
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(gc / gb if gb > 0 else math.inf, facts.config.gap_ratio),
        onset_series="work_gap_mean",
        evidence=evidence,
        lever=LEVER,
        summary=f"gaps between decode steps {gb * 1e3:.2f} -> {gc * 1e3:.2f} ms with decodes waiting",
    )
