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
from diagnosis.rules.base import best, make_finding, period_share, steps_missing, strength, ttft_share
from diagnosis.rules.oversized_batch import preemption_rate

CAUSE = "kv_cache_pressure"
LEVER = (
    "Give the KV cache more blocks (memory headroom, fewer replicas per device) or quantize it (fp8/int8 "
    "KV); otherwise lower max_num_seqs so the running set fits without preemption."
)


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """Preemptions per thousand steps up by `preemptions_per_kstep` and KV usage P90 >= `kv_full_share`."""
    cfg = facts.config
    if missing := steps_missing(facts, CAUSE):
        return missing
    symptoms = facts.regressed("tpot", "itl_max", "e2e", "ttft", "goodput", "throughput")
    rate_b, rate_c = preemption_rate(facts, 0), preemption_rate(facts, 1)
    usage = facts.step_current("kv_usage_p90")
    if not symptoms or not (rate_c - rate_b >= cfg.preemptions_per_kstep and usage >= cfg.kv_full_share):
        return None
    # Recompute shows as prefill in decode steps, blocked admission as queue time; when neither part
    # moved much, pinned usage with a preemption wave still explains half.
    share = best(0.5, ttft_share(facts, "queue", "prefill"), period_share(facts, "prefill_in_decode_steps"))
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(max(rate_c, 1e-9) / max(rate_b, cfg.preemptions_per_kstep / 2), 2.0),
        onset_series="preemptions",
        evidence=[
            Evidence("preemptions_per_1k_steps", rate_b, rate_c),
            Evidence("kv_usage_p90", facts.step_baseline("kv_usage_p90"), usage),
            Evidence("kv_usage_p50", *facts.step_pair("kv_usage_p50")),
            Evidence("kv_blocks_total", *facts.step_pair("kv_blocks_total_mean")),
            Evidence(
                "preemptions_per_request",
                facts.req_baseline("preemptions_per_request"),
                facts.req_current("preemptions_per_request"),
            ),
            Evidence("batch_size_mean", *facts.step_pair("batch_mean")),
        ],
        lever=LEVER,
        summary=f"preemptions {rate_b:.1f} -> {rate_c:.1f} per 1k steps with the KV pool {usage:.0%} used",
    )
