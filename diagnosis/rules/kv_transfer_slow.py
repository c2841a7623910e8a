"""kv_transfer_slow: in a disaggregated deployment, moving the prompt's KV cache from the prefill worker
to the decode worker got slow (a congested or mis-routed link, a fallback transport).

Evidence: the KV transfer's share of TTFT up, and transfer seconds per transferred prompt token up (the
inverse of bandwidth, since KV bytes are proportional to tokens).
"""

from __future__ import annotations

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding
from diagnosis.rules.base import (
    kv_transfer_slowed,
    make_finding,
    strength,
    ttft_share,
    with_consequences,
)

CAUSE = "kv_transfer_slow"
LEVER = (
    "Check the prefill-to-decode transport: link utilisation and errors, that RDMA/NVLink is in use rather "
    "than a TCP fallback, and the placement of prefill and decode workers."
)


def evaluate(facts: Facts) -> Finding | None:
    """KV transfer share of mean TTFT up by `kv_transfer_share_increase`, seconds per token up by
    `kv_transfer_per_token_ratio`. Share = KV transfer part of the TTFT change; at arrivals that did not
    rise, with the queue's (a dev run: transfer 0.04 -> 0.40 s, queue 0.01 -> 0.43 s, the transfer alone
    0.29 of the change: `unexplained`)."""
    cfg = facts.config
    symptoms = facts.regressed("ttft", "e2e", "goodput")
    slowed = kv_transfer_slowed(facts) if symptoms else None
    if slowed is None:
        return None  # nothing regressed, colocated serving (no transfer can be slow), or the link held
    shares, ratio = slowed
    per_token = facts.req_pair("kv_transfer_s_per_token")
    share = with_consequences(facts, ttft_share(facts, "kv_transfer"), (), ("kv_transfer",))
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(ratio, cfg.kv_transfer_per_token_ratio),
        onset_series="kv_transfer_mean",
        evidence=[
            Evidence("kv_transfer_share_of_ttft", shares[0], shares[1]),
            Evidence("kv_transfer_s_mean", *facts.req_pair("kv_transfer_mean")),
            Evidence("kv_transfer_s_per_token", per_token[0], per_token[1]),
            Evidence(
                "tokens_per_s_transferred",
                1 / per_token[0] if per_token[0] else None,
                1 / per_token[1] if per_token[1] else None,
            ),
        ],
        lever=LEVER,
        summary=f"KV transfer {shares[0]:.0%} -> {shares[1]:.0%} of TTFT; per-token time x{ratio:.1f}",
    )
