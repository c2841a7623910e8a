"""queueing_overload: more requests arrive than the engine serves; they wait in the queue.

Evidence: arrivals up, queue time up and explaining most of the TTFT change, and (with step data) a busy
step loop; without step spans (vLLM-shaped traces) also the queue's share of TTFT up, since a TTFT rise at
flat arrivals is not overload. Look-alike scheduler_stall has the queue grow with arrivals flat and gaps
between steps up;
look-alike routing_imbalance has arrivals up on one instance only, the fleet's flat.
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding
from diagnosis.rules import routing_imbalance
from diagnosis.rules.base import demand_grew, gaps_grew, make_finding, strength, ttft_share

CAUSE = "queueing_overload"
LEVER = (
    "Load is past the capacity knee: rate-limit or queue at the edge (admission control), or add "
    "instances; `stepscope bench` finds the knee to size against."
)


def _queue_share_grew(facts: Facts) -> bool:
    """Did the queue's share of mean TTFT grow by `queue_share_increase`? More arrivals past the knee
    make requests wait longer before they run, not only longer in total."""
    (qb, qc), (tb, tc) = facts.req_pair("queue_mean"), facts.req_pair("ttft_mean")
    if not (tb > 0 and tc > 0):
        return False
    return qc / tc - qb / tb >= facts.config.queue_share_increase


def evaluate(facts: Facts) -> Finding | None:
    """Arrival rate up by `arrival_ratio` beyond Poisson noise (`base.demand_grew`), queue time's share of
    the TTFT change >= `min_share_explained`, and no growth of the gaps between steps (`base.gaps_grew`)."""
    cfg = facts.config
    symptoms = facts.regressed("ttft", "e2e", "goodput", "tpot")
    arrivals = facts.req_ratio("rate_rps", math.nan)
    if not symptoms or not demand_grew(facts):
        return None
    if not facts.req_current("queue_mean") > facts.req_baseline("queue_mean"):
        return None
    if gaps_grew(facts):
        return None  # the loop stopped between steps with work waiting: a stall, not more work
    if facts.steps is None and not _queue_share_grew(facts):
        return None  # request-only: no busy loop to see, so the queue must take a larger part of TTFT
    if routing_imbalance.shifted(facts):
        return None  # more work here, the same on the fleet: the balancer moved it
    share = ttft_share(facts, "queue")
    evidence = [
        Evidence("arrival_rate_rps", *facts.req_pair("rate_rps")),
        Evidence("queue_s_mean", *facts.req_pair("queue_mean")),
        Evidence("ttft_s_mean", *facts.req_pair("ttft_mean")),
    ]
    if facts.steps is not None:
        busy = [
            (get("busy_s") + get("work_gap_s")) / (get("seconds") * max(1.0, get("instances") or 1.0))
            for get in (facts.step_baseline, facts.step_current)
        ]
        evidence += [
            Evidence("step_loop_busy_share", busy[0], busy[1]),
            Evidence("waiting_requests_mean", *facts.step_pair("waiting_mean")),
        ]
        if not busy[1] >= cfg.busy_share:
            return None
    elif facts.evidence_source() == "metrics":
        # No step loop to watch: the scraped queue grew while the running batch sat at its cap.
        (wb, wc), (rb, rc) = facts.engine_pair("waiting_mean"), facts.engine_pair("batch_mean")
        limit = facts.engine_pair("max_num_seqs_mean")[1]
        evidence += [
            Evidence("waiting_requests_mean", wb, wc),
            Evidence("running_requests_mean", rb, rc),
            Evidence("max_num_seqs", *facts.engine_pair("max_num_seqs_mean")),
        ]
        if not wc > wb or (limit > 0 and not rc >= cfg.busy_share * limit):
            return None
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(arrivals, cfg.arrival_ratio),
        onset_series="requests",
        evidence=evidence,
        lever=LEVER,
        summary=f"arrivals x{arrivals:.2f}; queue time explains {share:.0%} of the TTFT change",
    )
