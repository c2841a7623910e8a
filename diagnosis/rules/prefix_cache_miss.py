"""prefix_cache_miss: requests that used to share a cached prompt prefix no longer hit it.

Evidence: the cached share of prompt tokens collapsed and the number of distinct prefix keys per request
went up, at unchanged prompt lengths (longer prompts lower the cached share too: that is long_prompts),
with prefill (and the queue behind it) explaining the TTFT change.
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding
from diagnosis.rules import cache_affinity_lost
from diagnosis.rules.base import best, cache_share_fell, make_finding, period_share, strength, ttft_share

CAUSE = "prefix_cache_miss"
LEVER = (
    "Find what changed the prompt prefix or the cache key (a template edit, a timestamp or request id "
    "early in the system prompt, a new cache_salt); keep shared content first and byte-identical."
)


def evaluate(facts: Facts) -> Finding | None:
    """Cached share down by `cache_share_drop` (absolute) and to `cache_share_ratio` of the baseline or
    less, prompt lengths within `steady_prompt_ratio`."""
    cfg = facts.config
    # A miss costs prefill: it shows first in TTFT (or end to end). TPOT alone moving with the cached
    # share is the healthy mix drifting (more prefill riding along decodes), not a broken prefix.
    if not facts.regressed("ttft", "e2e", "goodput", "throughput"):
        return None
    symptoms = facts.regressed("ttft", "e2e", "goodput", "throughput", "tpot")
    cb, cc = facts.req_baseline("cached_share"), facts.req_current("cached_share")
    metrics = not cb > 0 and facts.metric_pair("prefix_hit_share")[0] > 0
    if metrics:  # request spans without cached tokens (vLLM's): the engine's own hit counters
        cb, cc = facts.metric_pair("prefix_hit_share")
    if not symptoms or not (math.isfinite(cb) and math.isfinite(cc)) or cb <= 0:
        return None
    if not cache_share_fell(cb, cc, cfg):
        return None
    lengths = facts.req_ratio("input_mean", math.inf)
    if not (1 / cfg.steady_prompt_ratio <= lengths <= cfg.steady_prompt_ratio):
        return None
    if cache_affinity_lost.scattered(facts):  # the same prompts on more replicas: not a changed prefix
        return None
    share = best(ttft_share(facts, "prefill", "queue"), period_share(facts, "prefill_in_decode_steps"))
    keys_b, keys_c = (
        facts.req_baseline("prefix_keys_per_request"),
        facts.req_current("prefix_keys_per_request"),
    )
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(cb / cc if cc > 0 else math.inf, 1 / cfg.cache_share_ratio),
        onset_series="cached_share",
        evidence=[
            Evidence("prefix_hit_share" if metrics else "cached_token_share", cb, cc),
            Evidence("prefix_keys_per_request", keys_b, keys_c),
            Evidence("input_tokens_mean", *facts.req_pair("input_mean")),
            Evidence("prefill_s_mean", *facts.req_pair("prefill_mean")),
        ],
        lever=LEVER,
        summary=f"cached share of prompt tokens {cb:.0%} -> {cc:.0%} at unchanged prompt lengths",
        from_metrics=metrics,
    )
