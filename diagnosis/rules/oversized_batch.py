"""oversized_batch: the engine runs more sequences per step than its latency budget allows.

Evidence: batch size up and the batch-size part of the decode step period explaining most of its change,
with no preemption wave (look-alike kv_cache_pressure: preemptions with KV usage pinned near full) and not
simply filled by more arrivals under an unchanged limit (that is queueing_overload).
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import (
    best,
    chunking_turned_off,
    engine_missing,
    make_finding,
    period_share,
    preemptions,
    strength,
)

CAUSE = "oversized_batch"
LEVER = (
    "Back max_num_seqs (or the token budget) off to the knee of step time vs batch size, with 20% "
    "headroom; `stepscope query step_time_by_batch` shows the curve."
)


def _grew_on_its_own(facts: Facts) -> bool:
    """Without a recorded limit: arrivals flat, steps as fast at equal batch size, gaps flat."""
    cfg = facts.config
    arrivals = facts.req_ratio("rate_rps", math.nan)
    split = facts.decomposition.get("step_period", {})
    speed = split.get("equal_batch_ratio", math.nan)
    gaps = facts.step_ratio("work_gap_mean", 1.0)
    return arrivals < cfg.arrival_ratio and speed < cfg.equal_batch_ratio and gaps < cfg.gap_ratio


def _admissions_follow_the_batch(facts: Facts) -> bool:
    """Does the extra prefill riding in decode steps come with the bigger batch? A running sequence is
    replaced when it finishes, so admissions per step (and their prefills, chunked as before) grow with
    the batch: at 8 -> 19 sequences the prefill part of the step-period change was 74% and the batch-size
    part 33%. Not so when chunking was turned off or prompts lengthened (prefill_interference,
    long_prompts)."""
    cfg = facts.config
    chunking_off = chunking_turned_off(facts)
    lengths = facts.req_ratio("input_mean", math.inf)
    return not chunking_off and 1 / cfg.steady_prompt_ratio <= lengths <= cfg.steady_prompt_ratio


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """Mean batch size up by `batch_ratio`; preemptions not up by `preemptions_per_kstep`; `max_num_seqs`
    raised by `limit_raise_ratio` (or, where it is not recorded, arrivals, equal-batch speed and gaps
    flat); share = batch-size part of the step-period change, plus the prefill-in-decode part when the
    admissions follow the batch (`_admissions_follow_the_batch`)."""
    cfg = facts.config
    if missing := engine_missing(facts, CAUSE):
        return missing
    metrics = facts.evidence_source() == "metrics"
    symptoms = facts.regressed("tpot", "itl_max", "e2e", "goodput")
    batch_b, batch_c = facts.engine_pair("batch_mean")
    batch = batch_c / batch_b if batch_b > 0 else 0.0
    if not symptoms or not batch >= cfg.batch_ratio:
        return None
    rate_name, rate_b, rate_c, threshold = preemptions(facts)
    if rate_c - rate_b >= threshold:
        return None
    # Step-weighted means: a change point a few steps late leaves the new limit in the baseline's max.
    limit_b, limit_c = facts.engine_pair("max_num_seqs_mean")
    limit_raised = limit_b > 0 and limit_c >= cfg.limit_raise_ratio * limit_b
    if limit_b > 0 and not limit_raised:
        return None  # the limit did not move: more arrivals or slower steps filled the batch
    if metrics and not limit_raised:
        return None  # without step times, only a recorded limit change tells it from other causes
    if not limit_raised and not _grew_on_its_own(facts):
        return None
    if metrics:
        # No step period to split: the limit moved, the batch followed it and nothing preempted, so the
        # configuration change is credited with the share kv_cache_pressure gets for its own evidence.
        share = 0.5
    else:
        share = period_share(facts, "batch_size")
        if _admissions_follow_the_batch(facts):
            share = best(share, share + period_share(facts, "prefill_in_decode_steps"))
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(batch, cfg.batch_ratio) + (0.5 if limit_raised else 0.0),
        onset_series="max_num_seqs" if limit_raised else "batch_mean",
        evidence=[
            Evidence("batch_size_mean", batch_b, batch_c),
            Evidence("max_num_seqs", limit_b, limit_c),
            Evidence("step_s_mean", *facts.step_pair("step_mean")),
            Evidence(rate_name, rate_b, rate_c),
            Evidence("arrival_rate_rps", *facts.req_pair("rate_rps")),
        ],
        lever=LEVER,
        summary=(
            f"max_num_seqs {limit_b:.0f} -> {limit_c:.0f} and the running batch x{batch:.2f}, no preemptions"
            if metrics
            else f"batch size x{batch:.2f}; the bigger batch explains {share:.0%} of the step period change"
        ),
        from_metrics=metrics,
    )
