"""The diagnosis's results as typed records, and their JSON (the contract in docs/diagnosis.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from collector.timerange import TimeRange


def clean(value: Any, digits: int = 6) -> Any:
    """A value fit for JSON: floats rounded to `digits` significant digits, NaN/inf as None."""
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        if abs(value) >= 1e6:  # unix times and byte counts keep their units digits
            return round(value, 3)
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: clean(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v, digits) for v in value]
    try:
        return clean(float(value), digits)
    except (TypeError, ValueError):
        return str(value)


@dataclass(frozen=True, slots=True)
class Regression:
    """A symptom that got worse: effect size past its threshold, significant, enough samples."""

    # ttft_p50 | ttft_p99 | tpot_p50 | tpot_p99 | e2e_p50 | e2e_p99 | itl_max_p99 | throughput | ...
    metric: str
    baseline: float
    current: float
    ratio: float
    p_value: float
    n_baseline: int = 0
    n_current: int = 0
    # "baseline": the current window against the baseline window. "peers": one instance's latency over its
    # peers' in the same time blocks, current against baseline (baseline and current are those ratios), for
    # an instance whose own baseline swung with load the whole fleet shared.
    against: str = "baseline"

    @property
    def family(self) -> str:
        """`ttft`, `tpot`, `e2e`, `itl_max`, `throughput`, `goodput` or `error_rate`."""
        return self.metric.rsplit("_p", 1)[0] if self.metric.endswith(("_p50", "_p99")) else self.metric

    def to_json(self) -> dict[str, Any]:
        return clean(
            {
                "metric": self.metric,
                "baseline": self.baseline,
                "current": self.current,
                "ratio": self.ratio,
                "p_value": self.p_value,
                "n_baseline": self.n_baseline,
                "n_current": self.n_current,
                "against": self.against,
            }
        )


@dataclass(frozen=True, slots=True)
class Evidence:
    """One measured quantity, on both sides."""

    metric: str
    baseline: Any
    current: Any

    def to_json(self) -> dict[str, Any]:
        return clean({"metric": self.metric, "baseline": self.baseline, "current": self.current})


@dataclass(frozen=True, slots=True)
class Finding:
    """A credible cause: the symptoms it explains, how sure, since when, the evidence, what to do."""

    cause: str
    symptoms: tuple[str, ...]
    confidence: float
    onset: float | None  # unix seconds
    evidence: tuple[Evidence, ...]
    lever: str
    sql: str
    summary: str = ""
    share_explained: float | None = None
    # {"kind": "fleet" | "instances", "instances": [...], "share_of_regression": x} (diagnosis/fleet.py)
    scope: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return clean(
            {
                "cause": self.cause,
                "scope": self.scope,
                "symptoms": list(self.symptoms),
                "confidence": round(self.confidence, 3),
                "onset": None if self.onset is None else round(self.onset, 3),
                "summary": self.summary,
                "share_explained": self.share_explained,
                "evidence": [e.to_json() for e in self.evidence],
                "lever": self.lever,
                "sql": self.sql,
            }
        )


@dataclass(frozen=True, slots=True)
class NotEnoughData:
    """A rule that could not run: the data it needs is absent (step spans, rpc timings, phases)."""

    cause: str
    missing: str

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "missing": self.missing}


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """The whole answer. `to_json()` is the documented format; text and markdown render from it."""

    window: TimeRange | None
    baseline: TimeRange | None
    regressions: tuple[Regression, ...] = ()
    findings: tuple[Finding, ...] = ()
    not_enough_data: tuple[NotEnoughData, ...] = ()
    decomposition: dict[str, Any] = field(default_factory=dict)
    baseline_source: str = "change_point"  # change_point | given
    data: dict[str, Any] = field(default_factory=dict)  # counts of what was read
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """`{"window", "baseline", "regressions", "findings", ...}`, findings most likely first."""
        return {
            "window": self.window.to_json() if self.window else None,
            "baseline": (self.baseline.to_json() | {"source": self.baseline_source})
            if self.baseline
            else None,
            "regressions": [r.to_json() for r in self.regressions],
            "findings": [f.to_json() for f in self.findings],
            "not_enough_data": [n.to_json() for n in self.not_enough_data],
            "decomposition": clean(self.decomposition),
            "data": clean(self.data),
            "notes": list(self.notes),
        }
