"""weight_quant_off: the model's weights are no longer quantized (int8 -> fp32/bf16): every step reads
more bytes and takes longer at the same batch size.

Evidence: step time at equal batch size up, bytes read per step (at equal batch size) up, and the
`weight_dtype` step attribute changed at the onset. Look-alike oversized_batch: step time up because the
batch grew, at unchanged speed per batch size.
"""

from __future__ import annotations

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import make_finding, period_share, steps_missing, strength

CAUSE = "weight_quant_off"
LEVER = (
    "Restore the quantized weights (check the deployment's dtype/quantization flag and the checkpoint "
    "loaded); decode is memory-bound, so int8 weights read ~4x fewer bytes than fp32."
)


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """Equal-batch step time up by `equal_batch_ratio`, and the weight dtype changed or bytes per step at
    equal batch size up by `bytes_ratio`. Share = equal-batch part of the step-period change."""
    cfg = facts.config
    if missing := steps_missing(facts, CAUSE, "step time at equal batch size, weight dtype, bytes read"):
        return missing
    symptoms = facts.regressed("tpot", "itl_max", "e2e", "ttft", "throughput", "goodput")
    split = facts.decomposition.get("step_period", {})
    if not symptoms or not split.get("available"):
        return None
    speed = split["equal_batch_ratio"]
    bytes_ratio = split["bytes_ratio_equal_batch"]
    dtype_b, dtype_c = facts.steps[0].get("weight_dtype_top", ""), facts.steps[1].get("weight_dtype_top", "")
    dtype_changed = bool(dtype_b and dtype_c and dtype_b != dtype_c)
    if not speed >= cfg.equal_batch_ratio or not (dtype_changed or bytes_ratio >= cfg.bytes_ratio):
        return None
    share = period_share(facts, "equal_batch_step_time")
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(speed, cfg.equal_batch_ratio) + (0.5 if dtype_changed else 0.0),
        onset_series="weight_dtype_is_last" if dtype_changed else "bytes_mean",
        evidence=[
            Evidence("weight_dtype", dtype_b, dtype_c),
            Evidence("step_time_ratio_at_equal_batch", 1.0, speed),
            Evidence("bytes_read_ratio_at_equal_batch", 1.0, bytes_ratio),
            Evidence("batch_size_mean", *facts.step_pair("batch_mean")),
        ],
        lever=LEVER,
        summary=f"step time x{speed:.2f} at equal batch size; weights {dtype_b or '?'} -> {dtype_c or '?'}",
    )
