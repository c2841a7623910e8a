"""kv_cache_pressure: the KV-cache pool is too small for the running set; sequences get preempted and
recomputed, and new ones wait for blocks.

Evidence: preemptions up with KV usage pinned near full (a tenth of the steps or more see the pool
>= `kv_full_share` used: the P90 of usage, not the median, because a busy pool empties between long
prompts; the median step of a real run with 69 preemptions per 1k steps saw it 81% used). Look-alike
oversized_batch: batch size up with no preemptions.
"""

from __future__ import annotations

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import (
    best,
    engine_missing,
    make_finding,
    period_share,
    preemptions,
    strength,
    ttft_share,
)

CAUSE = "kv_cache_pressure"
LEVER = (
    "Give the KV cache more blocks (memory headroom, fewer replicas per device) or quantize it (fp8/int8 "
    "KV); otherwise lower max_num_seqs so the running set fits without preemption."
)


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """Preemptions up by `preemptions_per_kstep` per thousand steps (or `preemptions_per_min` from a
    scraped counter that counts no steps) and KV usage P90 >= `kv_full_share` (of the steps, or of the
    scrapes)."""
    cfg = facts.config
    if missing := engine_missing(facts, CAUSE):
        return missing
    metrics = facts.evidence_source() == "metrics"
    symptoms = facts.regressed("tpot", "itl_max", "e2e", "ttft", "goodput", "throughput")
    rate_name, rate_b, rate_c, threshold = preemptions(facts)
    usage_b, usage = facts.engine_pair("kv_usage_p90")
    if not symptoms or not (rate_c - rate_b >= threshold and usage >= cfg.kv_full_share):
        return None
    # Recompute shows as prefill in decode steps, blocked admission as queue time; when neither part
    # moved much, pinned usage with a preemption wave still explains half.
    share = best(0.5, ttft_share(facts, "queue", "prefill"), period_share(facts, "prefill_in_decode_steps"))
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(max(rate_c, 1e-9) / max(rate_b, threshold / 2), 2.0),
        onset_series="preemptions",
        evidence=[
            Evidence(rate_name, rate_b, rate_c),
            Evidence("kv_usage_p90", usage_b, usage),
            Evidence("kv_usage_p50", *facts.engine_pair("kv_usage_p50")),
            Evidence("kv_blocks_total", *facts.engine_pair("kv_blocks_total_mean")),
            Evidence(
                "preemptions_per_request",
                facts.req_baseline("preemptions_per_request"),
                facts.req_current("preemptions_per_request"),
            ),
            Evidence("batch_size_mean", *facts.engine_pair("batch_mean")),
            Evidence("waiting_requests_mean", *facts.engine_pair("waiting_mean")),
        ],
        lever=LEVER,
        summary=f"{rate_name.replace('_', ' ')} {rate_b:.1f} -> {rate_c:.1f}, the KV pool {usage:.0%} used",
        from_metrics=metrics,
    )
