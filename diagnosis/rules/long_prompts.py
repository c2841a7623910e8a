"""long_prompts: the prompts got longer; prefill takes longer and the queue grows behind it.

Evidence: the prompt-length distribution shifted (mean and P90 up), or its long tail did (mean up by a
quarter, P99 by half: documents or retrieved context grew while the short turns of a shared-prefix chat,
often most of the requests, stayed), and prefill plus queue time explain most of the TTFT change.
Look-alikes: prefill_interference (prompt lengths unchanged, chunking off) and prefix_cache_miss (lengths
unchanged, cached share down).
"""

from __future__ import annotations

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding
from diagnosis.rules.base import best, make_finding, period_share, prompt_growth, strength, ttft_share

CAUSE = "long_prompts"
LEVER = (
    "Find what lengthened prompts (a client, a template, retrieval returning more context); cap input "
    "length or route long prompts to a prefill pool; chunked prefill keeps them from stalling decodes."
)


def evaluate(facts: Facts) -> Finding | None:
    """Mean prompt length up by `long_prompt_ratio` and P90 by `steady_prompt_ratio`, or the mean by
    `steady_prompt_ratio` and P99 by `long_prompt_tail_ratio`; share from prefill + queue (TTFT) or
    prefill riding in decode steps (TPOT)."""
    cfg = facts.config
    symptoms = facts.regressed("ttft", "e2e", "tpot", "itl_max", "goodput", "throughput")
    body, tail = prompt_growth(facts)
    if not symptoms or not (body or tail):
        return None
    mean_ratio, p99_ratio = facts.req_ratio("input_mean", 0.0), facts.req_ratio("input_p99", 0.0)
    share = best(ttft_share(facts, "prefill", "queue"), period_share(facts, "prefill_in_decode_steps"))
    if facts.regressed("throughput", "goodput") and not share >= cfg.min_share_explained:
        share = cfg.min_share_explained  # longer prompts cut capacity even when no latency part moved
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=max(
            strength(mean_ratio, cfg.long_prompt_ratio) if body else 0.0,
            strength(p99_ratio, cfg.long_prompt_tail_ratio) if tail else 0.0,
        ),
        # One split that two series vote on: the mean prompt, which a few long documents set (a tail
        # that grew), and the mean log of the part the engine prefills (prompts that all grew): a shared
        # system prompt the cache holds is most of a chat turn's tokens, and a few 2k-token documents
        # among 100-token turns set a second's mean alone. Per request, that log told a x3 growth at
        # 0.68-1.05 standard deviations, the whole prompt's length at 0.44-0.56.
        onset_series=("input_mean", "uncached_log_mean"),
        evidence=[
            Evidence("input_tokens_mean", *facts.req_pair("input_mean")),
            Evidence("input_tokens_p50", *facts.req_pair("input_p50")),
            Evidence("input_tokens_p90", *facts.req_pair("input_p90")),
            Evidence("input_tokens_p99", *facts.req_pair("input_p99")),
            Evidence("prefill_s_mean", *facts.req_pair("prefill_mean")),
            Evidence("queue_s_mean", *facts.req_pair("queue_mean")),
        ],
        lever=LEVER,
        summary=(
            f"prompts x{mean_ratio:.2f} longer (mean), the longest x{p99_ratio:.2f} (P99); "
            f"prefill + queue explain {share:.0%}"
        ),
    )
