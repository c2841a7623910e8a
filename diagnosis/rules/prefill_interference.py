"""prefill_interference: long prefills run in the same steps as decodes and stall them.

Evidence: decode steps carry much larger prefill chunks (P99 of prefill tokens in mixed steps up), most
often because chunked prefill was turned off, at unchanged prompt lengths (look-alike long_prompts: the
prompt-length distribution shifted).
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import chunking_turned_off, make_finding, period_share, steps_missing, strength

CAUSE = "prefill_interference"
LEVER = (
    "Turn chunked prefill on (or lower long_prefill_token_threshold) so a long prompt is split across "
    "steps; at scale, disaggregate prefill and decode (PD) onto separate workers."
)


def _same_prefill_work(facts: Facts) -> bool:
    """Larger chunks with chunking still on are interference only when the prefill work did not grow:
    uncached prompt tokens per request (prefix misses), batch size and preemptions (recompute) steady."""
    cfg = facts.config
    ub, uc = facts.req_baseline("uncached_mean"), facts.req_current("uncached_mean")
    batch = facts.step_ratio("batch_mean", math.inf)
    preempt = 1000 * (
        facts.step_current("preemptions") / max(facts.step_current("steps"), 1)
        - facts.step_baseline("preemptions") / max(facts.step_baseline("steps"), 1)
    )
    return (
        uc <= cfg.steady_prompt_ratio * ub and batch < cfg.batch_ratio and preempt < cfg.preemptions_per_kstep
    )


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """P99 prefill tokens in decode steps up by `prefill_chunk_ratio`, prompt lengths within
    `steady_prompt_ratio` (`long_prompt_ratio` when chunking was turned off), and chunking turned off
    (or else the prefill work per request, batch size and
    preemptions unchanged); share from the prefill part of the step period, or 0.7 for inter-token stalls."""
    cfg = facts.config
    if missing := steps_missing(facts, CAUSE, "prefill riding in decode steps, chunked prefill per step"):
        return missing
    symptoms = facts.regressed("itl_max", "tpot", "e2e", "ttft")
    pb, pc = facts.step_baseline("mixed_prefill_p99"), facts.step_current("mixed_prefill_p99")
    chunk = pc / pb if pb > 0 else (math.inf if pc > 0 else 0.0)
    if not symptoms or not chunk >= cfg.prefill_chunk_ratio:
        return None
    lengths = facts.req_ratio("input_mean", math.inf)
    chunking_off = chunking_turned_off(facts)
    # Chunking turned off is the change itself: then only a long_prompts-sized shift competes (a mix of
    # ~100 requests with 1-2k-token documents moved its mean prompt x1.32 between halves by chance).
    if not lengths <= (cfg.long_prompt_ratio if chunking_off else cfg.steady_prompt_ratio):
        return None
    if not chunking_off and not _same_prefill_work(facts):
        return None
    share = period_share(facts, "prefill_in_decode_steps")
    if facts.regressed("itl_max"):
        share = max(share, 0.7) if math.isfinite(share) else 0.7
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(chunk, cfg.prefill_chunk_ratio) + (0.5 if chunking_off else 0.0),
        onset_series="chunked_share" if chunking_off else "mixed_prefill_max",
        evidence=[
            Evidence("chunked_prefill_share", *facts.step_pair("chunked_share")),
            Evidence("prefill_tokens_in_decode_steps_p99", pb, pc),
            Evidence(
                "prefill_tokens_in_decode_steps_max",
                facts.step_baseline("mixed_prefill_max"),
                facts.step_current("mixed_prefill_max"),
            ),
            Evidence("input_tokens_mean", *facts.req_pair("input_mean")),
            Evidence("itl_max_s_p99", *facts.req_pair("itl_max_p99")),
        ],
        lever=LEVER,
        summary=f"decode steps carry x{chunk:.1f} larger prefill chunks (P99) at unchanged prompt lengths",
    )
