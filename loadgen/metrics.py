"""Figures of one step from its request records: percentiles, throughput, goodput, SLO attainment, fluidity.

Definitions (all client-side):
- TTFT: send to the first token event. TPOT: (E2E - TTFT) / (output tokens - 1). ITL: gaps between token
  events. E2E: send to the end of the stream. Percentiles interpolate linearly (numpy's default) over the
  requests that completed.
- A request meets the SLO when it completed, its TTFT <= the TTFT SLO and its TPOT <= the TPOT SLO (a
  one-token request has no TPOT and passes that half). An SLO that is not set always passes.
- SLO attainment: requests meeting the SLO / requests issued (failures count as misses).
- Goodput: requests meeting the SLO per second of the step, as DistServe defines it.
- Rates count what finished inside the step's issuing window (see `step_figures`).
- Fluidity index (Etalon): every token gets a deadline, the first at the TTFT SLO, each next one a TPOT SLO
  later; a token early by some margin banks it as slack for later ones; a late token counts every deadline
  it overran as missed and resets the schedule from its arrival. The index is the share of deadlines met,
  pooled over the step's completed requests. Each token event (SSE chunk with text) is one token here.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.client import RequestRecord

QUANTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets in seconds (None: no target) and the attainment a healthy step must reach."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    target: float = 0.9

    def __post_init__(self) -> None:
        for v in (self.ttft_s, self.tpot_s):
            if v is not None and v <= 0:
                raise ValueError("SLO latencies must be > 0")
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"SLO attainment target must be in (0, 1], got {self.target}")

    @property
    def is_set(self) -> bool:
        """Whether any latency target is given."""
        return self.ttft_s is not None or self.tpot_s is not None


def percentiles(values: Iterable[float], qs: Sequence[int] = QUANTILES) -> dict[str, float | None]:
    """`{"p50": .., "p90": .., "p99": .., "mean": ..}`; every figure None when there are no values."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    out: dict[str, float | None] = {f"p{q}": (float(np.percentile(a, q)) if a.size else None) for q in qs}
    out["mean"] = float(a.mean()) if a.size else None
    return out


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    """Completed, and within both latency targets that are set."""
    if not rec.ok:
        return False
    if slo.ttft_s is not None and rec.ttft_s > slo.ttft_s:  # type: ignore[operator]
        return False
    tpot = rec.tpot_s
    return slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s


def slo_attainment(records: Sequence[RequestRecord], slo: SLO) -> float | None:
    """Share of issued requests that meet the SLO (None when none were issued)."""
    if not records:
        return None
    return sum(meets_slo(r, slo) for r in records) / len(records)


def goodput(records: Sequence[RequestRecord], slo: SLO, elapsed_s: float) -> float:
    """Requests per second that meet the SLO."""
    return sum(meets_slo(r, slo) for r in records) / elapsed_s if elapsed_s > 0 else 0.0


def fluidity(gaps_s: Sequence[float], prefill_deadline_s: float, decode_deadline_s: float) -> tuple[int, int]:
    """(deadlines met, deadlines in all) for one request; `gaps_s[0]` is the TTFT, then the token gaps."""
    met = total = 0
    slack = 0.0
    for i, gap in enumerate(gaps_s):
        deadline = prefill_deadline_s if i == 0 else decode_deadline_s
        if gap <= deadline + slack:
            slack += deadline - gap
            met += 1
            total += 1
        else:
            missed = math.floor((gap - slack - deadline) / decode_deadline_s) + 1
            total += missed
            slack = 0.0
    return met, total


def fluidity_index(records: Sequence[RequestRecord], slo: SLO) -> float | None:
    """Share of per-token deadlines met over the completed requests (None without both SLOs)."""
    if slo.ttft_s is None or slo.tpot_s is None:
        return None
    met = total = 0
    for r in records:
        if r.ok:
            m, t = fluidity([r.ttft_s, *r.itl_s], slo.ttft_s, slo.tpot_s)  # type: ignore[list-item]
            met, total = met + m, total + t
    return met / total if total else None


def _tokens_within(r: RequestRecord, window_s: float) -> float:
    """Output tokens of `r` made by `window_s`, pro rata to its token events (a chunk may carry several)."""
    if not r.token_times_s:
        return 0.0
    inside = sum(t <= window_s for t in r.token_times_s)
    return r.output_tokens * inside / len(r.token_times_s)


def step_figures(
    records: Sequence[RequestRecord], elapsed_s: float, slo: SLO, window_s: float | None = None
) -> dict[str, Any]:
    """Every figure of one step, JSON-ready.

    Rates (throughput, goodput) count what finished inside the measurement window `[0, window_s]` (the
    issuing period; default the whole run): requests still draining after it ran at a falling load and
    would bias rates down. Latency percentiles and SLO attainment cover every request of the step.
    """
    window = window_s if window_s is not None and window_s < elapsed_s else elapsed_s
    done = [r for r in records if r.ok]
    in_window = [r for r in done if r.end_s <= window]  # type: ignore[operator]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_tokens_est for r in done)
    window_in_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else r.prompt_tokens_est for r in in_window
    )
    window_out_tokens = sum(_tokens_within(r, window) for r in done)
    per_s = (lambda x: x / window) if window > 0 else (lambda x: 0.0)
    errors = Counter(r.error for r in records if r.error)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "errors": dict(sorted(errors.items())),
        "error_rate": (len(records) - len(done)) / len(records) if records else 0.0,
        "duration_s": window,
        "elapsed_s": elapsed_s,
        "completed_in_window": len(in_window),
        "request_throughput_rps": per_s(len(in_window)),
        "output_token_throughput_tps": per_s(window_out_tokens),
        "total_token_throughput_tps": per_s(window_out_tokens + window_in_tokens),
        "goodput_rps": goodput(in_window, slo, window),
        "slo_attainment": slo_attainment(records, slo),
        "fluidity_index": fluidity_index(records, slo),
        "ttft_s": percentiles(r.ttft_s for r in done),
        "tpot_s": percentiles(r.tpot_s for r in done),
        "itl_s": percentiles(g for r in done for g in r.itl_s),
        "e2e_s": percentiles(r.e2e_s for r in done),
        "mean_prompt_tokens": in_tokens / len(done) if done else None,
        "mean_output_tokens": out_tokens / len(done) if done else None,
    }
