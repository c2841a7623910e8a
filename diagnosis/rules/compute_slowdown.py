"""compute_slowdown: the engine does the same work more slowly: a noisy neighbour on its cores, CPU or GPU
clocks held down (thermals, power caps), a slower device.

Evidence: step time at equal batch size up with the configuration unchanged (same weight dtype, bytes
per step and limits: look-alike weight_quant_off changes the dtype and the bytes read; look-alike
oversized_batch grows the batch instead). Which kind of slowdown, from the stepping thread's CPU time per
step (`steps.cpu_s`) against its wall time at equal batch size: wall up at about equal CPU means the
thread waited for a core (contention); CPU up with the wall means each step's work got slower (clocks,
thermals, a slower device). The CPU part is read from the share of a step's wall time the thread spent on
a core (`cpu_share`), which holds across batch sizes, so a backlog's larger batches compare too.
Contention while the engine core process's own CPU use rose is not this cause: the engine's other work
(its channel's encoding, KV transfers) took the cores (`own_work_grew`). Host counters joined to the
steps back it: the load average and runnable tasks above the cores, CPU steal, the engine process's share
of a core; on CUDA the SM clock against its maximum, NVML's clock-event (throttle) reasons and other
processes on the GPU.
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.records import Evidence, Finding, NotEnoughData
from diagnosis.rules.base import (
    best,
    make_finding,
    own_work_grew,
    period_share,
    steps_missing,
    strength,
    ttft_share,
    with_consequences,
)

CAUSE = "compute_slowdown"
WHAT = "step time at equal batch size, the stepping thread's CPU time per step"  # what only step spans carry
LEVER = (
    "Find what competes for the engine's cores or device: `top`/`pidstat` for other busy processes (pin "
    "the engine to dedicated cores with taskset/cpusets, isolate the GPU, move the neighbour); check CPU "
    "and GPU clocks and throttle reasons (`nvidia-smi -q -d PERFORMANCE,CLOCK`, thermals, power caps)."
)


def config_unchanged(facts: Facts) -> bool:
    """Weight dtype, bytes per step at equal batch size, the batch limits, chunking and the KV pool as
    before."""
    cfg = facts.config
    dtypes = [s.get("weight_dtype_top", "") for s in facts.steps or ({}, {})]
    if dtypes[0] and dtypes[1] and dtypes[0] != dtypes[1]:
        return False
    split = facts.decomposition.get("step_period", {})
    if split.get("bytes_ratio_equal_batch", 1.0) >= cfg.bytes_ratio:
        return False
    for key in ("max_num_seqs_mean", "max_num_batched_tokens_mean", "kv_blocks_total_mean", "chunked_share"):
        b, c = facts.step_pair(key)
        if b > 0 and not 1 / cfg.limit_raise_ratio <= c / b <= cfg.limit_raise_ratio:
            return False
    return True


def kind(facts: Facts, wall_ratio: float) -> tuple[str, float]:
    """("contention" | "slower_compute" | "unknown", the CPU-time ratio at equal batch size)."""
    cfg = facts.config
    split = facts.decomposition.get("step_period", {})
    cpu_ratio = split.get("cpu_ratio_equal_batch", math.nan)
    # The CPU a step took at equal batch size: from the share of its wall time the stepping thread spent on a
    # core, which does not depend on the batch sizes a side ran (a backlog's batches may have no match in
    # the baseline but the few steps a late split left there); else as measured at the common sizes.
    share_fall = cpu_share_ratio(facts)
    cpu_at_equal = wall_ratio * share_fall if math.isfinite(share_fall) else cpu_ratio
    if math.isfinite(cpu_at_equal) and math.isfinite(wall_ratio) and wall_ratio > 1:
        # the part of the wall-time growth the thread spent computing
        grown = (cpu_at_equal - 1) / (wall_ratio - 1)
        return ("slower_compute" if grown >= cfg.cpu_growth_share else "contention"), cpu_ratio
    load_b, load_c = facts.step_pair("host_load_per_cpu")
    if math.isfinite(load_c) and load_c >= cfg.host_overload_per_cpu and load_c > load_b:
        return "contention", cpu_ratio
    return "unknown", cpu_ratio


def cpu_share_ratio(facts: Facts) -> float:
    """The stepping thread's share of its steps' wall time on a core, current over baseline (nan without
    CPU time per step)."""
    b, c = facts.step_pair("cpu_share")
    return c / b if math.isfinite(b) and math.isfinite(c) and b > 0 else math.nan


def evaluate(facts: Facts) -> Finding | NotEnoughData | None:
    """Equal-batch step time up by `equal_batch_ratio`, or the stepping thread's share of its steps on a
    core down to `cpu_share_fall` of the baseline's, with the configuration unchanged; share = the
    equal-batch part of the step-period change (TPOT), or prefill's part of the TTFT change (with what a
    slower engine's backlog brings, when arrivals did not rise)."""
    cfg = facts.config
    if missing := steps_missing(facts, CAUSE, WHAT):
        return missing
    symptoms = facts.regressed("tpot", "itl_max", "e2e", "ttft", "throughput", "goodput")
    split = facts.decomposition.get("step_period", {})
    if not symptoms or not split.get("available"):
        return None
    speed = split["equal_batch_ratio"]
    slower = speed >= cfg.equal_batch_ratio
    share_fall = cpu_share_ratio(facts)
    waited = share_fall <= cfg.cpu_share_fall
    if not (slower or waited) or not config_unchanged(facts):
        return None
    if slower:
        how, cpu_ratio = kind(facts, speed)
    else:  # the thread on a core a fraction of its steps' wall time: waiting for one, whatever the batch
        how, cpu_ratio = "contention", split.get("cpu_ratio_equal_batch", math.nan)
    waited_strength = strength(1 / share_fall, 1 / cfg.cpu_share_fall) if share_fall > 0 else float(waited)
    if how == "contention" and own_work_grew(facts):
        return None  # the engine's own other work took the cores: it did more work, not the same slower
    share = best(period_share(facts, "equal_batch_step_time"), ttft_share(facts, "prefill"))
    share = with_consequences(facts, share, ("equal_batch_step_time",), ("prefill",))
    what = {
        "contention": "waiting for a core (contention): CPU time per step about as before",
        "slower_compute": "slower compute (clocks, thermals, device): CPU time per step up with the wall",
        "unknown": "no CPU time per step or host counters to tell contention from slower compute",
    }[how]
    evidence = [
        Evidence("slowdown_kind", "", how),
        Evidence("step_time_ratio_at_equal_batch", 1.0, speed),
        Evidence("step_cpu_ratio_at_equal_batch", 1.0, cpu_ratio),
        Evidence("step_cpu_share_of_wall", *facts.step_pair("cpu_share")),
        Evidence("step_s_mean", *facts.step_pair("step_mean")),
        Evidence("batch_size_mean", *facts.step_pair("batch_mean")),
        Evidence("host_load_1m", *facts.step_pair("host_load_1m")),
        Evidence("host_procs_running", *facts.step_pair("host_procs_running")),
        Evidence("host_cpu_steal", *facts.step_pair("host_cpu_steal")),
        Evidence("engine_cpu_share", *facts.step_pair("host_engine_cpu_share")),
    ]
    for key in ("gpu_sm_clock_ratio", "gpu_clocks_event_reasons", "gpu_processes"):
        b, c = facts.step_pair(key)
        if math.isfinite(b) or math.isfinite(c):
            evidence.append(Evidence(key, b, c))
    return make_finding(
        facts,
        CAUSE,
        symptoms=symptoms,
        share=share,
        strength_=max(strength(speed, cfg.equal_batch_ratio), waited_strength),
        onset_series="cpu_share" if how == "contention" else "step_mean",
        evidence=evidence,
        lever=LEVER,
        summary=(
            f"step time x{speed:.2f} at equal batch size with the configuration unchanged: {what}"
            if slower
            else f"the stepping thread on a core x{share_fall:.2f} as much of its steps' wall time as "
            f"before, with the configuration unchanged: {what}"
        ),
    )
