"""long_outputs: the answers got longer (a raised max_tokens, a prompt or model change that makes the model
verbose): each request decodes for longer, more of them run at once, and end-to-end latency grows.

Evidence: output tokens per request up, decode time and E2E up with the decode part explaining the E2E
change, at flat arrivals and prompt lengths. Look-alikes: oversized_batch (the batch grows because the
limit was raised: here the limit is unchanged and the batch grows because requests stay longer),
queueing_overload (arrivals up), long_prompts (prompt lengths up).
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding
from diagnosis.rules.base import best, make_finding, strength, ttft_share

CAUSE = "long_outputs"
LEVER = (
    "Find what lengthened the answers (a client raising max_tokens, a prompt or model change that makes "
    "the model verbose); cap max_tokens or add stop sequences, or add capacity for the longer decodes."
)


def evaluate(facts: Facts) -> Finding | None:
    """Mean output tokens up by `long_output_ratio`, arrivals below `arrival_ratio`, prompt lengths within
    `steady_prompt_ratio`, max_num_seqs not raised. Share = the decode part of the mean E2E change (and of
    the TTFT change through the queue, when requests now wait for longer-running ones)."""
    cfg = facts.config
    symptoms = facts.regressed("e2e", "ttft", "tpot", "itl_max", "goodput", "throughput")
    outputs = facts.req_ratio("output_mean", 0.0)
    if not symptoms or not outputs >= cfg.long_output_ratio:
        return None
    if not facts.req_ratio("rate_rps", 1.0) < cfg.arrival_ratio:
        return None
    lengths = facts.req_ratio("input_mean", 1.0)
    if not 1 / cfg.steady_prompt_ratio <= lengths <= cfg.steady_prompt_ratio:
        return None
    limit_b, limit_c = facts.step_pair("max_num_seqs_mean")
    if limit_b > 0 and limit_c >= cfg.limit_raise_ratio * limit_b:
        return None  # the limit was raised: oversized_batch's evidence
    decode_b, decode_c = facts.req_pair("decode_mean")
    e2e_b, e2e_c = facts.req_pair("e2e_mean")
    shares = [math.nan]
    if e2e_c > e2e_b and math.isfinite(decode_c - decode_b):
        shares.append(min(1.0, (decode_c - decode_b) / (e2e_c - e2e_b)))
    if facts.regressed("ttft"):
        shares.append(ttft_share(facts, "queue"))
    share = best(*shares)
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(outputs, cfg.long_output_ratio),
        onset_series="output_mean",
        evidence=[
            Evidence("output_tokens_mean", *facts.req_pair("output_mean")),
            Evidence("decode_s_mean", decode_b, decode_c),
            Evidence("e2e_s_mean", e2e_b, e2e_c),
            Evidence("tpot_s_mean", *facts.req_pair("tpot_mean")),
            Evidence("arrival_rate_rps", *facts.req_pair("rate_rps")),
            Evidence("input_tokens_mean", *facts.req_pair("input_mean")),
            Evidence("batch_size_mean", *facts.step_pair("batch_mean")),
            Evidence("kv_usage_mean", *facts.step_pair("kv_usage_mean")),
            Evidence("max_num_seqs", limit_b, limit_c),
        ],
        lever=LEVER,
        summary=f"answers x{outputs:.2f} longer (mean output tokens) at flat arrivals and prompt lengths",
    )
