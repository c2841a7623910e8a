"""routing_imbalance: the balancer sends one instance more than its share; it queues while its peers idle.

Evidence: an instance's share of the fleet's requests rose (`imbalance_share_ratio`, by
`imbalance_min_share_increase`) at fleet arrivals within `imbalance_fleet_rate_ratio`, and its queue time
rose more than its peers'. Told apart from queueing_overload (the fleet's arrivals are flat: the traffic
moved, it did not grow) and from compute_slowdown (that instance's share of requests is unchanged).
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.fleet import request_shares
from diagnosis.records import Evidence, Finding
from diagnosis.rules.base import best, make_finding, strength, ttft_share

CAUSE = "routing_imbalance"
LEVER = (
    "Check the router's balancer weights and health checks (a replica pinned by a stale weight or a sticky "
    "session): route by load (least_loaded, or prefix_aware's load bound) until the skew is gone."
)


def shifted(facts: Facts) -> tuple[str, float, float, list[float]] | None:
    """(instance, its baseline and current share of the requests, the fleet's request rates) when traffic
    moved onto one instance at flat fleet arrivals (None otherwise). Shared with queueing_overload, its
    look-alike on that instance alone."""
    loc, cfg = facts.fleet, facts.config
    if loc is None or len(loc.rows) < 2:
        return None
    shares = request_shares(loc, serving_only=True)  # a lost peer's share moving is lost_capacity
    totals = [
        sum(loc.side(n, i, "requests") for n in loc.rows if loc.side(n, i, "requests") > 0) for i in (0, 1)
    ]
    rates = [totals[0] / max(facts.baseline.seconds, 1e-9), totals[1] / max(facts.window.seconds, 1e-9)]
    if not rates[0] > 0 or rates[1] / rates[0] > cfg.imbalance_fleet_rate_ratio:
        return None
    name, (sb, sc) = max(shares.items(), key=lambda kv: _nan0(kv[1][1]) - _nan0(kv[1][0]))
    if not (sb > 0 and sc >= cfg.imbalance_share_ratio * sb and sc - sb >= cfg.imbalance_min_share_increase):
        return None
    return name, sb, sc, rates


def evaluate(facts: Facts) -> Finding | None:
    cfg = facts.config
    symptoms = facts.regressed("ttft", "e2e", "tpot", "goodput", "throughput")
    moved = shifted(facts) if symptoms else None
    if moved is None:
        return None
    loc = facts.fleet
    name, sb, sc, rates = moved
    qb, qc = loc.side(name, 0, "queue_mean"), loc.side(name, 1, "queue_mean")
    peers = [n for n in loc.rows if n != name]
    peer_q = [loc.side(n, 1, "queue_mean") for n in peers]
    peer_qc = sum(q for q in peer_q if math.isfinite(q)) / max(1, sum(math.isfinite(q) for q in peer_q))
    if not (math.isfinite(qc) and qc > _nan0(qb) and qc > peer_qc):
        return None
    share = best(ttft_share(facts, "queue"), 0.6 if "tpot" not in ",".join(symptoms) else math.nan)
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(sc / sb, cfg.imbalance_share_ratio),
        onset_series="queue_mean",
        evidence=[
            Evidence(f"request_share[{name}]", sb, sc),
            Evidence(f"queue_s_mean[{name}]", qb, qc),
            Evidence("queue_s_mean[peers]", math.nan, peer_qc),
            Evidence("fleet_requests_per_s", *rates),
        ],
        lever=LEVER,
        summary=f"{name} got {sb:.0%} -> {sc:.0%} of the requests at flat fleet arrivals; it queues "
        f"({_nan0(qb) * 1e3:.0f} -> {qc * 1e3:.0f} ms) while its peers wait {peer_qc * 1e3:.0f} ms",
    )


def _nan0(x: float) -> float:
    return x if math.isfinite(x) else 0.0
