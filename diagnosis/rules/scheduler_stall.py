"""scheduler_stall: the step loop stops between steps while decodes wait (a lock, a GC pause, a blocking
call in the loop).

Evidence: gaps between consecutive decode steps up (look-alike queueing_overload: arrivals up, the loop
busy with steps and no gaps) and the front end's RPC delay unchanged where it is measured (look-alike
rpc_overhead: the delay between a step's end and the front end seeing its tokens is what grew).
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.model import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import make_finding, period_share, steps_missing, strength

CAUSE = "scheduler_stall"
LEVER = (
    "Profile the step loop between steps (py-spy dump, lock contention, GC): move the blocking work "
    "(locks held by other threads, logging, metrics export, tokenization) off the loop."
)


def rpc_grew(facts: Facts) -> bool | None:
    """Did the front end's RPC delay grow past its thresholds? None when it is not measured."""
    cfg = facts.config
    if not (facts.b("with_rpc") > 0 and facts.c("with_rpc") > 0):
        return None
    rb, rc = facts.b("rpc_delay_mean"), facts.c("rpc_delay_mean")
    return rc - rb >= cfg.min_rpc_increase_s and rc >= cfg.rpc_ratio * rb


def channel_dominates(facts: Facts) -> bool:
    """Did the RPC delay grow by at least `rpc_share_of_gap` of the gaps' growth? A slow channel also
    slows the core's encoding (gaps grow), and a stall also delays a few frames (the delay grows): which
    grew more says where the time went."""
    rpc = facts.c("rpc_delay_mean") - facts.b("rpc_delay_mean")
    gap = facts.sc("work_gap_mean") - facts.sb("work_gap_mean") if facts.steps is not None else 0.0
    if not math.isfinite(gap) or gap <= 0:
        return True
    return rpc >= facts.config.rpc_share_of_gap * gap


def gaps_grew(facts: Facts) -> bool:
    """Did the mean gap before decode steps grow past `gap_ratio` and `min_gap_increase_s`?

    Queueing cannot do that: with requests waiting the loop starts the next step at once (overload at
    4x arrivals kept the gap at 0.49 -> 0.51 ms; a 100 ms stall every 100-250 ms took it to 18-20 ms).
    """
    cfg = facts.config
    if facts.steps is None:
        return False
    gb, gc = facts.sb("work_gap_mean"), facts.sc("work_gap_mean")
    return gc - gb >= cfg.min_gap_increase_s and gc >= cfg.gap_ratio * gb


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """Mean gap before decode steps up by `gap_ratio` and `min_gap_increase_s`; RPC delay not grown, or
    grown by less than `rpc_share_of_gap` of the gaps' growth (`channel_dominates`).
    Share = gaps' part of the step-period change. Arrivals are reported, not tested: more arrivals do
    not open gaps between steps (`gaps_grew`), and a stall's queue makes the change point land where
    arrivals happen to bunch."""
    if missing := steps_missing(facts, CAUSE):
        return missing
    symptoms = facts.regressed("tpot", "itl_max", "e2e", "ttft", "throughput", "goodput")
    gb, gc = facts.sb("work_gap_mean"), facts.sc("work_gap_mean")
    if not symptoms or not gaps_grew(facts) or (rpc_grew(facts) and channel_dominates(facts)):
        return None
    share = period_share(facts, "gaps")
    evidence = [
        Evidence("gap_before_decode_step_s_mean", gb, gc),
        Evidence("gap_before_decode_step_s_p99", facts.sb("work_gap_p99"), facts.sc("work_gap_p99")),
        Evidence("step_s_mean", facts.sb("step_mean"), facts.sc("step_mean")),
        Evidence("arrival_rate_rps", facts.b("rate_rps"), facts.c("rate_rps")),
    ]
    if rpc_grew(facts) is not None:
        evidence.append(Evidence("rpc_delay_s_mean", facts.b("rpc_delay_mean"), facts.c("rpc_delay_mean")))
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
