"""What every rule shares: the Rule shape, evidence strength, and how a finding is put together.

A rule is a module with `CAUSE`, `LEVER` and `evaluate(facts) -> Finding | NotEnoughData | None`: a data
precondition (NotEnoughData when what it needs was not recorded), an evidence test with effect sizes
(None when the evidence is absent), and a confidence from the share of the symptom's change its part
explains times how far the evidence is past its threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from diagnosis import queries, stats
from diagnosis.config import DiagnosisConfig
from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData

Rule = Callable[[Facts], "Finding | NotEnoughData | None"]


def strength(ratio: float, threshold: float) -> float:
    """0 at the threshold, 1 at its square (ratios) and beyond; for ratios below 1 pass their inverse."""
    if not (math.isfinite(ratio) and ratio > 0 and threshold > 1):
        return 1.0 if ratio == math.inf else 0.0
    return max(0.0, min(1.0, math.log(ratio) / math.log(threshold) - 1.0))


def steps_missing(facts: Facts, cause: str, what: str) -> NotEnoughData | None:
    """NotEnoughData when there are no engine.step rows on both sides; `what` names what only step spans
    carry that the rule needs (scraped /metrics pages do not have it)."""
    if facts.steps is None or not (facts.step_baseline("steps") > 0 and facts.step_current("steps") > 0):
        scraped = " (scraped engine metrics do not carry it)" if facts.engine is not None else ""
        return NotEnoughData(cause, f"engine.step spans: {what}{scraped}")
    return None


def engine_missing(facts: Facts, cause: str) -> NotEnoughData | None:
    """NotEnoughData when neither engine.step spans nor scraped engine samples cover both sides."""
    if facts.evidence_source() is None:
        return NotEnoughData(
            cause,
            "engine.step spans or scraped engine metrics (neither steps nor engine_samples has rows in both "
            "windows; `stepscope collector --scrape URL` reads an engine's /metrics)",
        )
    return None


def preemptions(facts: Facts) -> tuple[str, float, float, float]:
    """(evidence name, baseline, current, threshold of the increase) of the preemptions per thousand engine
    steps. Steps are counted by step spans, or by a scraped vllm:iteration_tokens_total; else estimated
    as generated tokens over the mean running batch (a decode step makes one token per running sequence;
    steps that only prefill are missed, which errs towards a higher rate on both sides alike). Without
    either, preemptions per minute against `preemptions_per_min`."""
    cfg = facts.config
    if facts.evidence_source() == "steps":
        (pb, pc), (sb, sc) = facts.step_pair("preemptions"), facts.step_pair("steps")
        return "preemptions_per_1k_steps", 1000 * pb / sb, 1000 * pc / sc, cfg.preemptions_per_kstep
    (pb, pc), (sb, sc) = facts.metric_pair("preemptions"), facts.metric_pair("engine_steps_sum")
    if sb > 0 and sc > 0:
        return "preemptions_per_1k_steps", 1000 * pb / sb, 1000 * pc / sc, cfg.preemptions_per_kstep
    (tb, tc), (bb, bc) = facts.metric_pair("generation_tokens_sum"), facts.metric_pair("batch_mean")
    if tb > 0 and tc > 0 and bb > 0 and bc > 0:
        rates = 1000 * pb * bb / tb, 1000 * pc * bc / tc
        return "preemptions_per_1k_steps_est", *rates, cfg.preemptions_per_kstep
    return "preemptions_per_min", *facts.metric_pair("preemptions_per_min"), cfg.preemptions_per_min


def ttft_share(facts: Facts, *parts: str) -> float:
    """Largest share of the TTFT change (mean or tail) explained by `parts` (queue, prefill, kv_transfer)."""
    d = facts.decomposition.get("ttft", {})
    if not d.get("available"):
        return math.nan
    best = math.nan
    for label in ("mean", "tail"):
        shares = d[label]["share"]
        s = sum(shares.get(p, math.nan) for p in parts)
        if math.isfinite(s) and not (s <= best):
            best = s
    return best


def period_share(facts: Facts, *parts: str) -> float:
    """Share of the decode step period's change explained by `parts` of the step-period split."""
    d = facts.decomposition.get("step_period", {})
    if not d.get("available"):
        return math.nan
    return sum(d["share"].get(p, math.nan) for p in parts)


def best(*values: float) -> float:
    """Largest finite value (NaN when none)."""
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


# -- evidence tests that tell look-alike causes apart (used by more than one rule) ----------------
def with_consequences(facts: Facts, share: float, period: tuple[str, ...], ttft: tuple[str, ...]) -> float:
    """`share`, or more when arrivals did not rise: an engine that lost capacity (`period` and `ttft`: the
    parts that hold the cause itself) falls behind the same arrivals, and the fuller batch, the prefills
    riding in decode steps and the queue that follow are its doing too."""
    if arrivals_rose(facts):
        return share
    behind = period_share(facts, *period, "batch_size", "prefill_in_decode_steps") if period else math.nan
    return best(share, behind, ttft_share(facts, *ttft, "queue"))


def arrivals_rose(facts: Facts, p: float | None = None) -> bool:
    """Did arrivals rise: by `arrival_ratio` and beyond Poisson noise (one-sided rate test under `p`,
    default `arrival_p`)? The rules that need arrivals flat ask this: ~70 requests a side spread their
    ratio by ~0.17 at an unchanged rate."""
    cfg = facts.config
    if not facts.req_ratio("rate_rps", 1.0) >= cfg.arrival_ratio:
        return False
    counts = facts.req_current("arrivals"), facts.req_baseline("arrivals")
    rates = facts.req_current("rate_rps"), facts.req_baseline("rate_rps")
    if not all(r > 0 for r in rates):
        return True
    seconds = counts[0] / rates[0], counts[1] / rates[1]
    bar = cfg.arrival_p if p is None else p
    return stats.rate_greater(counts[0], seconds[0], counts[1], seconds[1]) < bar


def demand_grew(facts: Facts) -> bool:
    """Did demand grow, beyond doubt: arrivals up by `arrival_ratio` under the stricter `demand_p`. What
    overload needs, and what a busier spell of the same demand (`unexplained.load_explains`) must not show.
    Stricter than `arrivals_rose`, which vetoes: the split was searched where the sides differ most, so a
    Poisson burst of one rate passes 0.01 in some healthy runs."""
    return arrivals_rose(facts, facts.config.demand_p)


def prompt_growth(facts: Facts) -> tuple[bool, bool]:
    """How the prompts got longer, as `long_prompts` reads it: (the body: mean by `long_prompt_ratio` and
    P90 by `steady_prompt_ratio`; the long tail alone: mean by `steady_prompt_ratio` and P99 by
    `long_prompt_tail_ratio`). The upper tail, not the median: a mixed workload (chat + shared prefix)
    has a bimodal length distribution whose median jumps between modes in healthy runs."""
    cfg = facts.config
    mean = facts.req_ratio("input_mean", 0.0)
    body = mean >= cfg.long_prompt_ratio and facts.req_ratio("input_p90", 0.0) >= cfg.steady_prompt_ratio
    tail = mean >= cfg.steady_prompt_ratio and facts.req_ratio("input_p99", 0.0) >= cfg.long_prompt_tail_ratio
    return body, tail


def rpc_grew(facts: Facts) -> bool | None:
    """Did the front end's RPC delay grow past its thresholds? None when it is not measured."""
    cfg = facts.config
    if not (facts.req_baseline("with_rpc") > 0 and facts.req_current("with_rpc") > 0):
        return None
    rb, rc = facts.req_baseline("rpc_delay_mean"), facts.req_current("rpc_delay_mean")
    return rc - rb >= cfg.min_rpc_increase_s and rc >= cfg.rpc_ratio * rb


def cache_share_fell(before: float, after: float, cfg: DiagnosisConfig) -> bool:
    """Did the cached share of prompt tokens fall: by `cache_share_drop` and to `cache_share_ratio` of
    what it was?"""
    return before > 0 and before - after >= cfg.cache_share_drop and after / before <= cfg.cache_share_ratio


def kv_transfer_slowed(facts: Facts) -> tuple[tuple[float, float], float] | None:
    """((baseline, current) share of the mean TTFT spent moving the prompt's KV to the decode worker, the
    ratio of its seconds per transferred token) when the transfer slowed: the share up by
    `kv_transfer_share_increase` and the per-token time by `kv_transfer_per_token_ratio`. None otherwise,
    and on colocated serving (no transfer)."""
    cfg = facts.config
    if not (facts.req_baseline("with_kv_transfer") > 0 or facts.req_current("with_kv_transfer") > 0):
        return None
    (tb, tc), (kb, kc) = facts.req_pair("ttft_mean"), facts.req_pair("kv_transfer_mean")
    shares = (kb / tb if tb > 0 else math.nan, kc / tc if tc > 0 else math.nan)
    pb, pc = facts.req_pair("kv_transfer_s_per_token")
    ratio = pc / pb if pb > 0 else math.inf
    if shares[1] - shares[0] >= cfg.kv_transfer_share_increase and ratio >= cfg.kv_transfer_per_token_ratio:
        return shares, ratio
    return None


def frontend_grew(facts: Facts) -> bool:
    """Did the front end's own time per request (HTTP receipt -> the core's queue) grow past
    `frontend_ratio` and `min_frontend_increase_s`?"""
    cfg = facts.config
    fb, fc = facts.req_pair("frontend_mean")
    return fc - fb >= cfg.min_frontend_increase_s and fc >= cfg.frontend_ratio * fb


def loop_busy(facts: Facts) -> bool:
    """Did the front end's event loop get busy: its lag grew by at least the RPC delay's growth, and its
    own time per request (HTTP receipt -> the core's queue) past `frontend_ratio` and
    `min_frontend_increase_s`? Then tokens reach the client late because the loop reads them late (a
    front end short of CPU: lag +192 ms against a delay +27 ms), not because the channel carries them
    slowly (a slow codec: the delay grows by more than the lag)."""
    lag = facts.req_current("loop_lag_mean") - facts.req_baseline("loop_lag_mean")
    rpc = facts.req_current("rpc_delay_mean") - facts.req_baseline("rpc_delay_mean")
    return frontend_grew(facts) and math.isfinite(lag) and math.isfinite(rpc) and lag >= rpc


def channel_dominates(facts: Facts) -> bool:
    """Did the RPC delay grow by at least `rpc_share_of_gap` of the gaps' growth? A slow channel also
    slows the core's encoding (gaps grow), and a stall also delays a few frames (the delay grows): which
    grew more says where the time went."""
    rpc = facts.req_current("rpc_delay_mean") - facts.req_baseline("rpc_delay_mean")
    gap = (
        facts.step_current("work_gap_mean") - facts.step_baseline("work_gap_mean")
        if facts.steps is not None
        else 0.0
    )
    if not math.isfinite(gap) or gap <= 0:
        return True
    return rpc >= facts.config.rpc_share_of_gap * gap


def own_work_grew(facts: Facts) -> bool:
    """Did the engine core process's own CPU use (cores' worth, from /proc) rise past `own_cpu_rise` and
    `own_cpu_ratio`? When its stepping thread waits for a core meanwhile, the engine's other work (its
    channel's encoding, KV transfers) took the core, not a neighbour."""
    cfg = facts.config
    b, c = facts.step_pair("host_engine_cpu_share") if facts.steps is not None else (math.nan, math.nan)
    return b > 0 and c - b >= cfg.own_cpu_rise and c >= cfg.own_cpu_ratio * b


def gaps_grew(facts: Facts) -> bool:
    """Did the mean gap before decode steps grow past `gap_ratio` and `min_gap_increase_s`?

    Queueing cannot do that: with requests waiting the loop starts the next step at once (overload at
    4x arrivals kept the gap at 0.49 -> 0.51 ms; a 100 ms stall every 100-250 ms took it to 18-20 ms).
    """
    cfg = facts.config
    if facts.steps is None:
        return False
    gb, gc = facts.step_baseline("work_gap_mean"), facts.step_current("work_gap_mean")
    return gc - gb >= cfg.min_gap_increase_s and gc >= cfg.gap_ratio * gb


def chunking_turned_off(facts: Facts) -> bool:
    """Did the share of steps with chunked prefill on drop by `chunking_off_share`?"""
    return (
        facts.step_baseline("chunked_share") - facts.step_current("chunked_share")
        >= facts.config.chunking_off_share
    )


def make_finding(
    facts: Facts,
    cause: str,
    *,
    symptoms: tuple[str, ...],
    share: float,
    strength_: float,
    onset_series: str | tuple[str, ...],
    evidence: list[Evidence],
    lever: str,
    summary: str,
    from_metrics: bool = False,
) -> Finding | None:
    """A finding with confidence share x (0.6 + 0.4 strength), or None when it explains too little. With
    `from_metrics` the evidence came from scraped engine samples: the summary says so and the SQL reads
    engine_intervals."""
    cfg = facts.config
    if not symptoms or not math.isfinite(share) or share < cfg.min_share_explained:
        return None
    confidence = min(1.0, share) * (0.6 + 0.4 * max(0.0, min(1.0, strength_)))
    if confidence < cfg.min_confidence:
        return None
    span_start = min(facts.baseline.start, facts.window.start)
    iv = max(1, round(facts.series.interval_s))
    if from_metrics:
        summary += " (from scraped engine metrics)"
    sql = queries.render(
        (queries.EVIDENCE_METRICS if from_metrics else queries.EVIDENCE)[cause],
        {"iv": int(iv), "t0": int(span_start * 1e9), "t1": int(facts.window.end * 1e9)},
    )
    return Finding(
        cause=cause,
        symptoms=symptoms,
        confidence=confidence,
        onset=facts.onset(onset_series),
        evidence=tuple(evidence),
        lever=lever,
        sql=sql,
        summary=summary,
        share_explained=min(1.0, share),
    )
