"""The capacity knee of a step-load run, the load to recommend below it, and what 1,000 requests cost there.

Method (docs/loadgen.md has the reasoning):
1. A step is past the knee when it fails outright: its error rate exceeds `1 - target` (the service shed or
   broke), or, with SLOs set, its SLO attainment is below `target`.
2. Or when a P99 latency (TTFT or TPOT) rises steeply from the previous step: its elasticity to load,
   `ln(p99_i / p99_{i-1}) / ln(load_i / load_{i-1})`, is at least `elasticity` (default 1: latency grows as
   fast as load, so by Little's law more load buys no more throughput), and the rise is material: at
   least `min_rise_fraction` of that metric's SLO, or `min_rise_ttft_s` / `min_rise_tpot_s` without one.
   P99 needs about 100 requests per step to mean anything; with fewer, P90 (10 or more) or P50 stand in.
3. The knee is the first such step; with none, there is "no knee within the tested range".
The recommended load is `(1 - headroom)` times the last load before the knee (the highest tested load when
there is no knee; none when the very first step is past the knee).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from loadgen.metrics import SLO


@dataclass(frozen=True, slots=True)
class KneeConfig:
    """Thresholds of knee detection, each with its reason in docs/loadgen.md."""

    elasticity: float = 1.0
    min_rise_fraction: float = 0.1
    min_rise_ttft_s: float = 0.1
    min_rise_tpot_s: float = 0.01
    headroom: float = 0.2

    def __post_init__(self) -> None:
        if self.elasticity <= 0:
            raise ValueError("knee elasticity must be > 0")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError("headroom must be in [0, 1)")


@dataclass(frozen=True, slots=True)
class Knee:
    """Where the knee is (`found`, its step `index` and `load`), which figure showed it, and why."""

    found: bool
    index: int | None = None
    load: float | None = None
    metric: str | None = None
    reason: str = "no knee within the tested range"

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def _fails(step: dict[str, Any], slo: SLO) -> tuple[str, str] | None:
    if step["error_rate"] > 1.0 - slo.target:
        return "error_rate", f"error rate {step['error_rate']:.0%} above {1 - slo.target:.0%}"
    att = step.get("slo_attainment")
    if slo.is_set and att is not None and att < slo.target:
        return "slo_attainment", f"SLO attainment {att:.0%} below the {slo.target:.0%} target"
    return None


def tail_quantile(num_samples: int) -> int:
    """The highest of P99, P90, P50 that `num_samples` requests can estimate (about 1/(1-q) samples needed):
    a P99 of five requests is their maximum, and one slow request would make a knee."""
    return 99 if num_samples >= 100 else 90 if num_samples >= 10 else 50


def _steep(prev: dict, cur: dict, load_ratio: float, slo: SLO, cfg: KneeConfig) -> tuple[str, str] | None:
    q = tail_quantile(min(prev.get("completed", 100), cur.get("completed", 100)))
    for name, slo_s, floor_s in (
        ("ttft", slo.ttft_s, cfg.min_rise_ttft_s),
        ("tpot", slo.tpot_s, cfg.min_rise_tpot_s),
    ):
        a, b = prev[f"{name}_s"][f"p{q}"], cur[f"{name}_s"][f"p{q}"]
        if a is None or b is None or a <= 0 or b <= a:
            continue
        elasticity = math.log(b / a) / math.log(load_ratio)
        min_rise = cfg.min_rise_fraction * slo_s if slo_s is not None else floor_s
        if elasticity >= cfg.elasticity and b - a >= min_rise:
            label = f"P{q} {name.upper()}"
            why = f"{label} {a * 1e3:.0f} -> {b * 1e3:.0f} ms, elasticity {elasticity:.1f} to load"
            return f"{name}_p{q}", why
    return None


def find_knee(loads: Sequence[float], steps: Sequence[dict[str, Any]], slo: SLO, cfg: KneeConfig) -> Knee:
    """The first step past the knee (see the module docstring), or `Knee(found=False)`."""
    for i, step in enumerate(steps):
        hit = _fails(step, slo)
        if hit is None and i > 0 and loads[i] > loads[i - 1]:
            hit = _steep(steps[i - 1], step, loads[i] / loads[i - 1], slo, cfg)
        if hit is not None:
            return Knee(True, i, float(loads[i]), hit[0], hit[1])
    return Knee(False)


def recommended_load(loads: Sequence[float], knee: Knee, cfg: KneeConfig) -> float | None:
    """`(1 - headroom)` times the last load before the knee; None when the first step is already past it."""
    if not loads:
        return None
    if not knee.found:
        return (1.0 - cfg.headroom) * float(loads[-1])
    if knee.index == 0:
        return None
    return (1.0 - cfg.headroom) * float(loads[knee.index - 1])  # type: ignore[operator]


def throughput_at(loads: Sequence[float], throughputs: Sequence[float], load: float) -> float:
    """Request throughput at `load`, interpolated linearly between tested loads and (0, 0)."""
    xs = np.concatenate([[0.0], np.asarray(loads, dtype=float)])
    ys = np.concatenate([[0.0], np.asarray(throughputs, dtype=float)])
    order = np.argsort(xs, kind="stable")
    return float(np.interp(load, xs[order], ys[order]))


def cost_per_1k_requests(cost_per_hour: float, throughput_rps: float) -> float | None:
    """Cost of serving 1,000 requests at `throughput_rps` on a machine costing `cost_per_hour`."""
    if throughput_rps <= 0:
        return None
    return cost_per_hour / (throughput_rps * 3600.0) * 1000.0
