"""long_outputs: the answers got longer (a raised max_tokens, a prompt or model change that makes the model
verbose): each request decodes for longer, more of them run at once, and end-to-end latency grows.

Evidence: output tokens per request up, decode time and E2E up with the decode part explaining the E2E
change, at flat arrivals and prompt lengths; where the engine's running batch is known (step spans, or
scraped /metrics samples) it grew, or the queue did: requests that decode longer hold their slots longer.
Look-alikes: oversized_batch (the batch grows because the
limit was raised: here the limit is unchanged and the batch grows because requests stay longer),
queueing_overload (arrivals up), long_prompts (prompt lengths up).
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding
from diagnosis.rules.base import arrivals_rose, best, make_finding, prompt_growth, strength, ttft_share

CAUSE = "long_outputs"
LEVER = (
    "Find what lengthened the answers (a client raising max_tokens, a prompt or model change that makes "
    "the model verbose); cap max_tokens or add stop sequences, or add capacity for the longer decodes."
)


def evaluate(facts: Facts) -> Finding | None:
    """Mean output tokens up by `long_output_ratio`, arrivals not risen (`arrivals_rose`), the prompts
    not grown as long_prompts reads it (`prompt_growth`; a small baseline's mix can move the mean alone),
    max_num_seqs not raised; with engine evidence (steps or
    scraped samples) the running batch or the waiting queue up. Share = the decode part of the mean E2E
    change (and of the TTFT change through the queue, when requests now wait for longer-running ones)."""
    cfg = facts.config
    symptoms = facts.regressed("e2e", "ttft", "tpot", "itl_max", "goodput", "throughput")
    outputs = facts.req_ratio("output_mean", 0.0)
    if not symptoms or not outputs >= cfg.long_output_ratio:
        return None
    if arrivals_rose(facts):
        return None
    if any(prompt_growth(facts)):
        return None  # the prompts grew as long_prompts reads it: theirs is the evidence to weigh
    limit_b, limit_c = facts.engine_pair("max_num_seqs_mean")
    if limit_b > 0 and limit_c >= cfg.limit_raise_ratio * limit_b:
        return None  # the limit was raised: oversized_batch's evidence
    (batch_b, batch_c), (wait_b, wait_c) = facts.engine_pair("batch_mean"), facts.engine_pair("waiting_mean")
    if batch_b > 0 and not (batch_c > batch_b or wait_c > wait_b):
        return None  # nothing stays longer in the engine: the answers are not what holds it up
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
            Evidence("batch_size_mean", batch_b, batch_c),
            Evidence("kv_usage_mean", *facts.engine_pair("kv_usage_mean")),
            Evidence("waiting_requests_mean", wait_b, wait_c),
            Evidence("max_num_seqs", limit_b, limit_c),
        ],
        lever=LEVER,
        summary=_summary(facts, outputs, batch_b, batch_c),
    )


def _summary(facts: Facts, outputs: float, batch_b: float, batch_c: float) -> str:
    text = f"answers x{outputs:.2f} longer (mean output tokens) at flat arrivals and prompt lengths"
    if facts.evidence_source() == "metrics" and batch_b > 0:
        # The output lengths come from request spans; only the engine side is read from the scrape.
        text += f"; running batch {batch_b:.1f} -> {batch_c:.1f} (scraped engine metrics)"
    return text
