"""rpc_overhead: the channel between the engine core and the front end got slow (serialization, a
saturated socket, a busy front-end event loop).

Evidence: the front end's measured delay between the core producing a token and receiving it
(`rpc_delay_s`) grew. Look-alike scheduler_stall: only time between steps inside the core grew (core-side
encode time also shows there, which is why the front-end delay is the discriminating measurement).
Look-alike compute_slowdown: a replica held to a share of the CPU delays its front end's reads too, but
its steps also take longer at equal batch size, which a channel cannot do (the core encodes between
steps): then this rule stays out, unless the core process's own CPU use rose with it (its encoding took
the stepping thread's core: `own_work_grew`). Look-alike frontend_bottleneck: a front end short of CPU
reads every token late, so the delay grows too, but its event loop's lag grows by more (`loop_busy`):
this rule stays out.
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import (
    best,
    channel_dominates,
    loop_busy,
    make_finding,
    own_work_grew,
    rpc_grew,
    strength,
)

CAUSE = "rpc_overhead"
LEVER = (
    "Make the core-to-front-end channel cheaper: a faster codec (msgpack/zero-copy), fewer and larger "
    "messages (batch outputs per step), or more front-end processes; check the front end's event loop lag."
)


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """Mean RPC delay up by `rpc_ratio` and `min_rpc_increase_s`; share = (RPC delay change + change of
    gaps between steps) over the mean TPOT change, or the RPC delay change over the mean TTFT change,
    whichever regressed and is best explained."""
    cfg = facts.config
    if not (facts.req_baseline("with_rpc") > 0 and facts.req_current("with_rpc") > 0):
        return NotEnoughData(CAUSE, "stepscope.rpc.delay_mean_s on llm_request (front-end RPC delay)")
    symptoms = facts.regressed("tpot", "itl_max", "e2e", "ttft", "throughput", "goodput")
    rb, rc = facts.req_baseline("rpc_delay_mean"), facts.req_current("rpc_delay_mean")
    if not symptoms or not rpc_grew(facts):
        return None
    period = facts.decomposition.get("step_period", {})
    slower = period.get("available") and period.get("equal_batch_ratio", 1.0) >= cfg.equal_batch_ratio
    if slower and not own_work_grew(facts):
        return None  # the steps themselves got slower: the host or the device, not the channel
    if loop_busy(facts):
        return None  # the front end's loop reads late: frontend_bottleneck's evidence
    gap = facts.step_current("work_gap_mean") - facts.step_baseline("work_gap_mean")
    if not channel_dominates(facts):
        return None  # the gaps between steps grew far more: the loop stalled, the channel did not
    per_token = (rc - rb) + (gap if math.isfinite(gap) and gap > 0 else 0.0)
    # Every token crosses the channel: the delay's growth is its part of the mean TPOT change (which is
    # also how it reaches E2E, goodput and throughput) and, once, of the mean TTFT change.
    shares = [math.nan]
    tpot_change = facts.req_current("tpot_mean") - facts.req_baseline("tpot_mean")
    if facts.regressed("tpot", "itl_max", "e2e", "throughput", "goodput") and tpot_change > 0:
        shares.append(min(1.0, per_token / tpot_change))
    ttft_change = facts.req_current("ttft_mean") - facts.req_baseline("ttft_mean")
    if facts.regressed("ttft") and ttft_change > 0:
        shares.append(min(1.0, (rc - rb) / ttft_change))
    share = best(*shares)
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=strength(rc / rb if rb > 0 else math.inf, cfg.rpc_ratio),
        onset_series="rpc_delay_mean",
        evidence=[
            Evidence("rpc_delay_s_mean", rb, rc),
            Evidence("rpc_delay_max_s_p99", *facts.req_pair("rpc_delay_max_p99")),
            Evidence("gap_before_decode_step_s_mean", *facts.step_pair("work_gap_mean")),
            Evidence("tpot_s_mean", *facts.req_pair("tpot_mean")),
        ],
        lever=LEVER,
        summary=f"front-end RPC delay per token {rb * 1e3:.2f} -> {rc * 1e3:.2f} ms",
    )
