"""cache_affinity_lost: the same prompts, scattered over the replicas: every replica's cache reuse falls.

Evidence: the cached share of prompt tokens fell fleet-wide and on most serving instances (it rose on none
that held its share of the reuse before), and a repeated prompt prefix stopped landing where it went last
(the affinity share fell by `affinity_ratio`: each shared prefix reaches more instances) while the fleet's
distinct keys per request and the prompt lengths stayed put.
Told apart from prefix_cache_miss, where the prompts themselves changed (the fleet's distinct keys per
request rise).
"""

from __future__ import annotations

import math
from dataclasses import replace

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding
from diagnosis.rules.base import best, make_finding, period_share, strength, ttft_share

CAUSE = "cache_affinity_lost"
LEVER = (
    "Route by prefix (prefix_aware routing on the prompt's leading blocks, or session affinity) so that a "
    "shared prefix keeps landing where its KV blocks are cached."
)


def scattered(facts: Facts) -> tuple[float, float] | None:
    """(baseline, current) share of repeated prompt prefixes that landed where they went last, when the
    same prompts were scattered over more instances (None otherwise). Shared with prefix_cache_miss, its
    look-alike. The prompts are the fleet's: a router's switch changes which prompts each instance gets,
    so the mix of the instances a regression is localized to moves with it."""
    loc, cfg = facts.fleet, facts.config
    if loc is None or len(loc.rows) - len(loc.lost) < 2:
        return None
    ab, ac = loc.affinity
    fleet_keys = loc.fleet_ratio("prefix_keys_per_request", math.inf)
    if not (ab > 0 and ac * cfg.affinity_ratio <= ab and fleet_keys <= cfg.steady_prompt_ratio):
        return None
    return ab, ac


def evaluate(facts: Facts) -> Finding | None:
    cfg = facts.config
    symptoms = facts.regressed("ttft", "e2e", "goodput", "throughput")
    keys = scattered(facts) if symptoms else None
    if keys is None:
        return None
    loc = facts.fleet
    serving = [n for n in loc.rows if n not in loc.lost and loc.side(n, 1, "requests") > 0]
    cb, cc = facts.req_pair("cached_share")
    if not (math.isfinite(cb) and math.isfinite(cc) and cb - cc >= cfg.cache_share_drop):
        return None
    before = {n: loc.side(n, 0, "cached_share") for n in serving}
    drops = {n: before[n] - loc.side(n, 1, "cached_share") for n in serving}
    # Fell on most replicas, and rose on none that held its share of the reuse before: a replica that held
    # few of the shared prefixes (the router's overflow) had little reuse to lose, and scattered prompts
    # bring it some (a dev run: 0.00 -> 0.30 beside 0.66 -> 0.28 and 0.68 -> 0.40).
    fell = sum(math.isfinite(d) and d >= cfg.cache_share_drop / 2 for d in drops.values())
    rose = [n for n, d in drops.items() if math.isfinite(d) and d <= -cfg.cache_share_drop / 2]
    if fell * 2 < len(serving) or any(not before[n] < cb / 2 for n in rose):
        return None
    lengths = loc.fleet_ratio("input_mean", math.inf)
    if not (1 / cfg.steady_prompt_ratio <= lengths <= cfg.steady_prompt_ratio):
        return None
    share = best(ttft_share(facts, "prefill", "queue"), period_share(facts, "prefill_in_decode_steps"))
    finding = make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=max(strength(keys[0] / keys[1] if keys[1] > 0 else math.inf, cfg.affinity_ratio), 0.9),
        onset_series="cached_share",
        evidence=[
            Evidence("cached_token_share", cb, cc),
            Evidence("prefix_affinity_share", *keys),
            Evidence("instances_per_shared_prefix", *loc.spread),
            Evidence("prefix_keys_per_request", *loc.fleet_pair("prefix_keys_per_request")),
            Evidence("input_tokens_mean", *loc.fleet_pair("input_mean")),
        ]
        + [
            Evidence(
                f"cached_token_share[{n}]", loc.side(n, 0, "cached_share"), loc.side(n, 1, "cached_share")
            )
            for n in serving
        ],
        lever=LEVER,
        summary=f"cached share {cb:.0%} -> {cc:.0%} on every replica; {keys[1]:.0%} of repeated prefixes "
        f"land where they went last (was {keys[0]:.0%}) at unchanged prompts",
    )
    # the router's cause: the whole fleet's, though the symptoms may gather on the instances that held the
    # most reuse before
    return None if finding is None else replace(finding, scope=loc.fleet_scope())
