"""Symptoms: which of TTFT/TPOT/E2E quantiles, inter-token stalls, throughput, goodput and error rate got
worse between the baseline and the current window. A regression needs an effect size past its threshold,
a one-sided significance test under `alpha`, and enough samples on both sides (docs/diagnosis.md)."""

from __future__ import annotations

import math

import numpy as np

from diagnosis import stats
from diagnosis.config import DiagnosisConfig
from diagnosis.facts import Facts
from diagnosis.records import Regression

# metric -> (aggregate column, sample column, quantile)
LATENCY_METRICS: dict[str, tuple[str, str, float]] = {
    "ttft_p50": ("ttft_p50", "ttft_s", 0.5),
    "ttft_p99": ("ttft_p99", "ttft_s", 0.99),
    "tpot_p50": ("tpot_p50", "tpot_s", 0.5),
    "tpot_p99": ("tpot_p99", "tpot_s", 0.99),
    "e2e_p50": ("e2e_p50", "e2e_s", 0.5),
    "e2e_p99": ("e2e_p99", "e2e_s", 0.99),
    "itl_max_p99": ("itl_max_p99", "tpot_max_s", 0.99),
}


def detect(facts: Facts) -> list[Regression]:
    """Every symptom that regressed, worst ratio first within latency, then rates."""
    cfg = facts.config
    out = [r for name in LATENCY_METRICS if (r := _latency(facts, name, cfg))]
    out.sort(key=lambda r: -r.ratio)
    for check in (_throughput, _goodput, _error_rate):
        r = check(facts, cfg)
        if r:
            out.append(r)
    return out


def _latency(facts: Facts, name: str, cfg: DiagnosisConfig) -> Regression | None:
    column, sample_column, q = LATENCY_METRICS[name]
    xb = facts.sample[0].get(sample_column, np.array([]))
    xc = facts.sample[1].get(sample_column, np.array([]))
    nb, nc = int(np.isfinite(xb).sum()), int(np.isfinite(xc).sum())
    need = cfg.min_requests_p99 if q > 0.5 else cfg.min_requests_p50
    if min(nb, nc) < need:
        return None
    base, cur = facts.req_baseline(column), facts.req_current(column)
    r = stats.ratio(cur, base)
    if not r >= (cfg.min_ratio_p99 if q > 0.5 else cfg.min_ratio_p50):
        return None
    times = _sample_times(facts)
    if q > 0.5:
        p = stats.exceedance_greater(xc, xb, q, times, cfg.sample_block_s)
    else:
        p = stats.mann_whitney_greater(xc, xb, times, cfg.sample_block_s, cfg.inflation_from_baseline)
    if p >= cfg.alpha:
        return None
    return Regression(name, base, cur, r, p, nb, nc)


def _sample_times(facts: Facts) -> tuple[np.ndarray, np.ndarray]:
    """(current, baseline) arrival times of the sampled requests, paired with `facts.sample`'s columns."""
    return facts.sample[1].get("t", np.array([])), facts.sample[0].get("t", np.array([]))


def _interval_rates(facts: Facts, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-interval values of series `name` inside the baseline and the current window."""
    s = facts.series
    x = s.get(name)
    t = s.start + np.arange(len(s)) * s.interval_s
    full_b = (t >= facts.baseline.start) & (t + s.interval_s <= facts.baseline.end)
    full_c = (t >= facts.window.start) & (t + s.interval_s <= facts.window.end)
    return np.nan_to_num(x[full_b]), np.nan_to_num(x[full_c])


def _throughput(facts: Facts, cfg: DiagnosisConfig) -> Regression | None:
    """Output tokens per second fell, by more than demand fell (fewer arrivals are not a regression)."""
    base, cur = facts.req_baseline("output_tokens_per_s"), facts.req_current("output_tokens_per_s")
    r = stats.ratio(cur, base)
    demand = stats.ratio(facts.req_current("rate_rps"), facts.req_baseline("rate_rps"))
    if not (r <= cfg.min_drop_rate and r / demand <= cfg.min_drop_rate):
        return None
    xb, xc = _interval_rates(facts, "output_tokens_sum")
    if min(len(xb), len(xc)) < cfg.min_intervals:
        return None
    p = stats.mann_whitney_greater(xb, xc)
    if p >= cfg.alpha:
        return None
    return Regression("throughput", base, cur, r, p, len(xb), len(xc))


def slo(facts: Facts) -> tuple[float, float]:
    """The SLO goodput counts against: the configured one, else the baseline's own P99 TTFT and TPOT."""
    cfg = facts.config
    ttft = cfg.slo_ttft_s if cfg.slo_ttft_s is not None else stats.quantile(facts.sample[0]["ttft_s"], 0.99)
    tpot = cfg.slo_tpot_s if cfg.slo_tpot_s is not None else stats.quantile(facts.sample[0]["tpot_s"], 0.99)
    return ttft, tpot


def slo_met(sample: dict[str, np.ndarray], ttft_slo: float, tpot_slo: float) -> tuple[int, int]:
    """(requests meeting the SLO, requests) in a sample; a missing TPOT (one output token) passes it."""
    met = slo_mask(sample, ttft_slo, tpot_slo)
    return int(met.sum()), len(met)


def slo_mask(sample: dict[str, np.ndarray], ttft_slo: float, tpot_slo: float) -> np.ndarray:
    """Per sampled request, whether it met the SLO (see `slo_met`)."""
    ttft, tpot, err = sample["ttft_s"], sample["tpot_s"], sample["is_error"]
    ok_ttft = ttft <= ttft_slo if math.isfinite(ttft_slo) else np.ones(len(ttft), bool)
    ok_tpot = (~np.isfinite(tpot)) | (tpot <= tpot_slo) if math.isfinite(tpot_slo) else True
    return ok_ttft & ok_tpot & (np.nan_to_num(err) == 0)


def _goodput(facts: Facts, cfg: DiagnosisConfig) -> Regression | None:
    """The share of requests meeting the SLO fell (reported as that share; `goodput_rps` in the data)."""
    ttft_slo, tpot_slo = slo(facts)
    mb, mc = (slo_mask(side, ttft_slo, tpot_slo) for side in facts.sample)
    kb, nb, kc, nc = int(mb.sum()), len(mb), int(mc.sum()), len(mc)
    if min(nb, nc) < cfg.min_requests_p99:
        return None
    base, cur = kb / nb, kc / nc
    r = stats.ratio(cur, base)
    if not r <= cfg.min_drop_rate:
        return None
    # Requests of one backlog miss the SLO together: the test's variance is widened as the latency tests'.
    tc, tb = _sample_times(facts)
    inflation = stats.variance_inflation([(mc, tc), (mb, tb)], cfg.sample_block_s)
    p = stats.two_proportion_greater(nc - kc, nc, nb - kb, nb, inflation)
    if p >= cfg.alpha:
        return None
    return Regression("goodput", base, cur, r, p, nb, nc)


def _error_rate(facts: Facts, cfg: DiagnosisConfig) -> Regression | None:
    nb, nc = int(facts.req_baseline("requests") or 0), int(facts.req_current("requests") or 0)
    if min(nb, nc) < cfg.min_requests_p50:
        return None
    # Rates over the arrivals the rows stand for (failed requests are all kept, the rest head-sampled).
    eb, ec = (
        round(num0(facts.req_baseline("errors_weighted"))),
        round(num0(facts.req_current("errors_weighted"))),
    )
    nb = max(nb, round(num0(facts.req_baseline("arrivals"))))
    nc = max(nc, round(num0(facts.req_current("arrivals"))))
    base, cur = eb / nb, ec / nc
    if cur - base < cfg.min_error_rate_increase or not stats.ratio(cur, base) >= cfg.min_error_rate_ratio:
        return None
    p = stats.two_proportion_greater(ec, nc, eb, nb)
    if p >= cfg.alpha:
        return None
    return Regression("error_rate", base, cur, stats.ratio(cur, base), p, nb, nc)


def num0(x: float) -> float:
    """NaN as 0."""
    return x if math.isfinite(x) else 0.0
