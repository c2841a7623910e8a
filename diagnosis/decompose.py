"""Attribution: split each symptom's change into parts measured on the same requests and steps.

- TTFT = queue + prefill + KV transfer + the rest (front end, RPC), as means over the requests of each
  side, and over each side's slowest tenth (the tail a P99 regression lives in).
- The time between two decode steps (what TPOT is made of) = step time + gap. Its change splits into
  batch size (the current mix of batch sizes at baseline speed), step time at equal batch size (the
  current speed curve against the baseline's, at the current mix), prefill tokens riding in decode steps
  (the excess of mixed steps over pure decode steps at the same batch size), and gaps between steps.
  Speed curves are least-squares lines of pure-decode step time on batch size.
- Throughput: the step loop's wall time split into busy (steps), gaps while decodes wait, and idle.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from diagnosis.facts import Facts

TTFT_PARTS = ("queue", "prefill", "kv_transfer")


def share(part: float, total: float) -> float:
    """part / total for a positive total change, clipped to [-1, 1]; NaN otherwise."""
    if not (math.isfinite(part) and math.isfinite(total)) or total <= 0:
        return math.nan
    return max(-1.0, min(1.0, part / total))


def ttft(facts: Facts) -> dict[str, Any]:
    """Means of TTFT and its parts per side, their changes, and each part's share of the change."""
    if not (facts.req_baseline("with_queue") > 0 and facts.req_current("with_queue") > 0):
        return {"available": False, "missing": "gen_ai.latency.time_in_queue / time_in_model_prefill"}
    out: dict[str, Any] = {"available": True}
    for label, sides in (("mean", _mean_parts(facts)), ("tail", _tail_parts(facts))):
        b, c = sides
        delta = {k: c[k] - b[k] for k in b}
        out[label] = {
            "baseline": b,
            "current": c,
            "delta": delta,
            "share": {k: share(delta[k], delta["ttft"]) for k in b if k != "ttft"},
        }
    return out


def _mean_parts(facts: Facts) -> tuple[dict[str, float], dict[str, float]]:
    out = []
    for get in (facts.req_baseline, facts.req_current):
        parts = {"ttft": get("ttft_mean")} | {p: get(f"{p}_mean") for p in TTFT_PARTS}
        parts["other"] = parts["ttft"] - sum(np.nan_to_num(parts[p]) for p in TTFT_PARTS)
        out.append(parts)
    return out[0], out[1]


def _tail_parts(facts: Facts) -> tuple[dict[str, float], dict[str, float]]:
    out = []
    for sample in facts.sample:
        ttft = sample["ttft_s"]
        keys = ["ttft", *TTFT_PARTS, "other"]
        if np.isfinite(ttft).sum() < 10:
            out.append(dict.fromkeys(keys, math.nan))
            continue
        tail = np.isfinite(ttft) & (ttft >= np.nanquantile(ttft, 0.9))
        parts = {"ttft": float(np.mean(ttft[tail]))}
        for p in TTFT_PARTS:
            x = sample[f"{p}_s"][tail]
            parts[p] = float(np.nanmean(x)) if np.isfinite(x).any() else 0.0
        parts["other"] = parts["ttft"] - sum(parts[p] for p in TTFT_PARTS)
        out.append(parts)
    return out[0], out[1]


def speed_line(rows: list[dict[str, float]]) -> tuple[float, float]:
    """(intercept, slope) of step seconds on batch size, weighted by step counts, from pure-decode rows.
    With fewer than three batch sizes the slope is not trusted: (mean, nan)."""
    b = np.array([r["batch_size"] for r in rows], float)
    w = np.array([r["steps"] for r in rows], float)
    d = np.array([r["duration_sum"] / r["steps"] for r in rows], float)
    if len(rows) == 0 or w.sum() == 0:
        return math.nan, math.nan
    if len(rows) < 3:
        return float(np.average(d, weights=w)), math.nan
    sw = np.sqrt(w)
    design = np.vstack([np.ones_like(b), b]).T * sw[:, None]
    coef, *_ = np.linalg.lstsq(design, d * sw, rcond=None)
    return float(coef[0]), float(coef[1])


def _lines(facts: Facts) -> tuple[tuple[float, float], tuple[float, float]]:
    """Speed lines of both sides; a side without a trusted slope borrows the other's (shifted to match its
    own mean), and with neither the slope is 0."""
    pure = [
        [r for r in facts.shape if r["side"] == s and r["has_decode"] and not r["has_prefill"]]
        for s in (0, 1)
    ]
    lines = [speed_line(p) for p in pure]
    for s in (0, 1):
        a, slope = lines[s]
        if math.isnan(slope) and math.isfinite(a):
            other = lines[1 - s][1]
            slope = other if math.isfinite(other) else 0.0
            rows = pure[s]
            w = np.array([r["steps"] for r in rows], float)
            mean_b = float(np.average([r["batch_size"] for r in rows], weights=w))
            lines[s] = (a - slope * mean_b, slope)
    return lines[0], lines[1]


def step_period(facts: Facts) -> dict[str, Any]:
    """The decode step period (step time + gap, over steps that advance decodes) and its split."""
    if facts.steps is None:
        return {"available": False, "missing": "engine.step spans"}
    rows = [[r for r in facts.shape if r["side"] == s and r["has_decode"]] for s in (0, 1)]
    if not rows[0] or not rows[1]:
        return {"available": False, "missing": "decode steps on both sides"}
    (ab, kb), (ac, kc) = _lines(facts)
    if not all(map(math.isfinite, (ab, kb, ac, kc))):
        return {"available": False, "missing": "pure decode steps on both sides"}

    def fb(x: float) -> float:
        return ab + kb * x

    def fc(x: float) -> float:
        return ac + kc * x

    def side(s: int, f: Any) -> dict[str, float]:
        n = sum(r["steps"] for r in rows[s])
        w = [(r, r["steps"] / n) for r in rows[s]]
        return {
            "period": sum(wt * r["duration_sum"] / r["steps"] for r, wt in w)
            + sum(r["gap_sum"] for r in rows[s]) / n,
            "step": sum(wt * r["duration_sum"] / r["steps"] for r, wt in w),
            "gap": sum(r["gap_sum"] for r in rows[s]) / n,
            "at_base_speed": sum(wt * fb(r["batch_size"]) for r, wt in w),
            "at_own_speed": sum(wt * f(r["batch_size"]) for r, wt in w),
            "mixed_excess": sum(
                wt * (r["duration_sum"] / r["steps"] - f(r["batch_size"])) for r, wt in w if r["has_prefill"]
            ),
            "batch_mean": sum(wt * r["batch_size"] for r, wt in w),
            "bytes_per_step": sum(r["bytes_sum"] for r in rows[s]) / n,
        }

    b, c = side(0, fb), side(1, fc)
    parts = {
        "batch_size": c["at_base_speed"] - b["at_base_speed"],
        "equal_batch_step_time": c["at_own_speed"] - c["at_base_speed"],
        "prefill_in_decode_steps": c["mixed_excess"] - b["mixed_excess"],
        "gaps": c["gap"] - b["gap"],
    }
    total = c["period"] - b["period"]
    parts["residual"] = total - sum(parts.values())
    mean_batch_c = c["batch_mean"]
    return {
        "available": True,
        "baseline": b,
        "current": c,
        "delta": parts | {"period": total},
        "share": {k: share(v, total) for k, v in parts.items()},
        "equal_batch_ratio": _equal_batch_ratio(facts, fc(mean_batch_c), fb(mean_batch_c)),
        "equal_batch_ratio_lines": fc(mean_batch_c) / fb(mean_batch_c) if fb(mean_batch_c) > 0 else math.nan,
        "speed_lines": {"baseline": [ab, kb], "current": [ac, kc]},
        "bytes_ratio_equal_batch": _bytes_ratio(facts),
        "cpu_ratio_equal_batch": _cpu_ratio(facts),
    }


MIN_COMMON_STEPS = 8  # pure decode steps a side at the batch sizes both ran, to compare them as measured


def _at_common_batches(facts: Facts, value: str, count: str, min_steps: int = 1) -> float:
    """`value` summed per `count`, over pure decode steps, current over baseline, at the batch sizes both
    sides ran, weighted by the current side's counts; nan with fewer than `min_steps` counted there on
    either side."""
    per: list[dict[float, tuple[float, float]]] = [{}, {}]
    for r in facts.shape:
        if r["has_decode"] and not r["has_prefill"] and r.get(count, 0) > 0:
            per[int(r["side"])][r["batch_size"]] = (r[value] / r[count], r[count])
    common = set(per[0]) & set(per[1])
    if min(sum(per[s][k][1] for k in common) for s in (0, 1)) < min_steps:
        return math.nan
    num = sum(per[1][k][0] * per[1][k][1] for k in common)
    den = sum(per[0][k][0] * per[1][k][1] for k in common)
    return num / den if den > 0 else math.nan


def _equal_batch_ratio(facts: Facts, at_current: float, at_baseline: float) -> float:
    """Pure decode step time, current over baseline, at equal batch size: the speed lines' ratio at the
    current side's mean batch size, or, where both sides ran MIN_COMMON_STEPS or more steps at the same
    batch sizes, the ratio measured there (as `_cpu_ratio` and `_bytes_ratio` compare) when it is the
    larger. Each estimate misses a slowdown in one shape of data: the lines extrapolate a baseline at batch
    1-2 to a backlog's batch 8, and a split that lands after the onset leaves the backlog's first slow
    steps in the baseline, at the only batch sizes the two sides share."""
    lines = at_current / at_baseline if at_baseline > 0 else math.nan
    measured = _at_common_batches(facts, "duration_sum", "steps", MIN_COMMON_STEPS)
    if math.isnan(lines) and math.isnan(measured):
        return math.nan
    return float(np.nanmax([lines, measured]))


def _cpu_ratio(facts: Facts) -> float:
    """The stepping thread's CPU time per pure decode step (over the steps that recorded it), current over
    baseline, at the batch sizes both sides ran, weighted by the current side's steps."""
    return _at_common_batches(facts, "cpu_sum", "cpu_n")


def _bytes_ratio(facts: Facts) -> float:
    """Bytes read per pure decode step, current over baseline, at the batch sizes both sides ran."""
    return _at_common_batches(facts, "bytes_sum", "steps")


def throughput(facts: Facts) -> dict[str, Any]:
    """Per side: output tokens/s, and the step loop's wall time as busy, gaps while decodes wait, idle."""
    out: dict[str, Any] = {}
    for label, get, sget in (
        ("baseline", facts.req_baseline, facts.step_baseline),
        ("current", facts.req_current, facts.step_current),
    ):
        side = {"output_tokens_per_s": get("output_tokens_per_s"), "requests_per_s": get("rate_rps")}
        if facts.steps is not None:
            wall = get("seconds") * max(1.0, sget("instances") or 1.0)
            side |= {
                "busy_share": sget("busy_s") / wall,
                "waiting_gap_share": sget("work_gap_s") / wall,
                "idle_share": max(0.0, 1 - (sget("busy_s") + sget("work_gap_s")) / wall),
            }
        out[label] = side
    return out


def decompose(facts: Facts) -> dict[str, Any]:
    """All three splits, as the `decomposition` of the findings JSON."""
    return {"ttft": ttft(facts), "step_period": step_period(facts), "throughput": throughput(facts)}
