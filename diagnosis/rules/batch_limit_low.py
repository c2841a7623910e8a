"""batch_limit_low: the batch limit was lowered (a configuration rollback, a wrong value): the running
batch is pinned at a cap below what the load needs, and requests wait in the queue.

Evidence: `max_num_seqs` lowered with the running batch at (or near) the new cap, or
`max_num_batched_tokens` lowered with the steps that carry a prefill filling the new budget; the waiting
queue and queue time up at flat arrivals, the KV cache with room (look-alike kv_cache_pressure: the pool
is full and sequences are preempted) and steps no slower (look-alike compute_slowdown). Look-alike
queueing_overload has the arrivals up at an unchanged limit.

Without step spans the running batch, the queue, KV usage and max_num_seqs come from scraped /metrics
samples, where the engine publishes the limit (stepscope:max_num_seqs, sglang:max_running_requests); vLLM
publishes none, and no engine publishes max_num_batched_tokens, so there the rule says what it lacks.
"""

from __future__ import annotations

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import arrivals_rose, best, make_finding, steps_missing, strength, ttft_share

CAUSE = "batch_limit_low"
WHAT = "the batch limits in force (max_num_seqs, max_num_batched_tokens)"  # what only step spans carry
UNPUBLISHED = (
    "the batch limit in force: the scraped /metrics publish no max_num_seqs (stepscope:max_num_seqs or "
    "sglang:max_running_requests carry it; vLLM publishes none) and no engine's page carries "
    "max_num_batched_tokens; engine.step spans carry both"
)
LEVER = (
    "Put max_num_seqs (and max_num_batched_tokens) back: at the knee of step time vs batch size with 20% "
    "headroom (`stepscope query step_time_by_batch` shows the curve; `stepscope bench` finds the knee)."
)


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """A batch limit (its step-weighted mean) down by `limit_raise_ratio` and binding: for max_num_seqs the
    current batch's mean at `batch_at_cap_share` of the new cap or more, for max_num_batched_tokens (where
    steps record it) the steps that carry a prefill filled to that share of the new budget. Then queue
    time up, arrivals not risen (`arrivals_rose`), KV usage P90 below
    `kv_full_share`. Share = the queue part of
    the TTFT change. From scraped samples: max_num_seqs only, as published (the scrapes' means)."""
    cfg = facts.config
    metrics = facts.evidence_source() == "metrics"
    if not metrics and (missing := steps_missing(facts, CAUSE, WHAT)):
        return missing
    seqs_b, seqs_c = facts.engine_pair("max_num_seqs_mean")
    if metrics and not (seqs_b > 0 and seqs_c > 0):
        return NotEnoughData(CAUSE, UNPUBLISHED)
    symptoms = facts.regressed("ttft", "e2e", "goodput", "throughput")
    if not symptoms:
        return None
    budget_b, budget_c = facts.step_pair("max_num_batched_tokens_mean")  # NaN from samples
    batch_b, batch_c = facts.engine_pair("batch_mean")
    fill_b, fill_c = facts.step_pair("prefill_step_tokens_mean")
    peak = facts.metric_pair("max_num_seqs_max")[1] if metrics else facts.step_current("max_num_seqs_max")
    seqs_cap = min(peak, seqs_c)
    budget_cap = min(facts.step_current("max_num_batched_tokens_max"), budget_c)
    bound: list[tuple[str, float, float]] = []  # (limit, before, after) of each lowered limit that binds
    if (
        seqs_c > 0
        and seqs_b >= cfg.limit_raise_ratio * seqs_c
        and batch_c >= cfg.batch_at_cap_share * seqs_cap
    ):
        bound.append(("max_num_seqs", seqs_b, seqs_c))
    if (
        budget_c > 0
        and budget_b >= cfg.limit_raise_ratio * budget_c
        and fill_c >= cfg.batch_at_cap_share * budget_cap
    ):
        bound.append(("max_num_batched_tokens", budget_b, budget_c))
    if not bound:
        return None  # no limit was lowered, or the load does not reach the lower one
    if not facts.req_current("queue_mean") > facts.req_baseline("queue_mean"):
        return None
    if arrivals_rose(facts):
        return None
    if facts.engine_pair("kv_usage_p90")[1] >= cfg.kv_full_share:
        return None
    share = best(ttft_share(facts, "queue"))
    if facts.regressed("throughput", "goodput") and not share >= cfg.min_share_explained:
        share = cfg.min_share_explained  # a lower cap cuts capacity even where latency parts hid it
    limit, before, after = max(bound, key=lambda b: b[1] / b[2])
    evidence = [Evidence(name, b, a) for name, b, a in bound]
    if limit == "max_num_batched_tokens":
        evidence.append(Evidence("prefill_step_tokens_mean", fill_b, fill_c))
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(before / after, cfg.limit_raise_ratio),
        onset_series=limit,
        evidence=[
            *evidence,
            Evidence("batch_size_mean", batch_b, batch_c),
            Evidence("waiting_requests_mean", *facts.engine_pair("waiting_mean")),
            Evidence("queue_s_mean", *facts.req_pair("queue_mean")),
            Evidence("arrival_rate_rps", *facts.req_pair("rate_rps")),
            Evidence("kv_usage_p90", *facts.engine_pair("kv_usage_p90")),
            *([] if metrics else [Evidence("step_s_mean", *facts.step_pair("step_mean"))]),
        ],
        lever=LEVER,
        summary=(
            f"{limit} {before:.0f} -> {after:.0f}: the batch is pinned at the lower limit while requests "
            f"queue at flat arrivals"
        ),
        from_metrics=metrics,
    )
