"""The two arrival tests the rules share: `arrivals_rose` (a veto: may demand have grown?) and `demand_grew`
(overload's own evidence: did it grow beyond doubt?). The change point is searched where the sides differ
most, so a Poisson burst of one rate passes the veto's bar in some healthy runs, never overload's."""

from __future__ import annotations

import numpy as np

from collector.timerange import TimeRange
from diagnosis.config import DiagnosisConfig
from diagnosis.facts import Facts
from diagnosis.rules.base import arrivals_rose, demand_grew


def _facts(baseline: tuple[int, float], current: tuple[int, float]) -> Facts:
    """Facts with (arrivals, seconds) per side and nothing else."""
    (kb, tb), (kc, tc) = baseline, current
    req = ({"arrivals": kb, "rate_rps": kb / tb}, {"arrivals": kc, "rate_rps": kc / tc})
    return Facts(
        window=TimeRange(tb, tb + tc),
        baseline=TimeRange(0.0, tb),
        req=req,
        sample=({}, {"t": np.array([])}),
        steps=None,
        shape=[],
        series=None,  # type: ignore[arg-type]
        config=DiagnosisConfig(),
    )


def test_a_burst_within_poisson_noise_of_a_searched_split_is_not_demand_growth():
    burst = _facts((80, 30.0), (190, 50.0))  # x1.43, one-sided p ~0.005
    assert arrivals_rose(burst)  # enough to veto the causes that need arrivals flat
    assert not demand_grew(burst)  # not enough to call it overload


def test_a_real_rise_in_demand_passes_both():
    surge = _facts((80, 30.0), (400, 50.0))  # x3
    assert arrivals_rose(surge) and demand_grew(surge)


def test_flat_arrivals_pass_neither():
    flat = _facts((80, 30.0), (135, 50.0))
    assert not arrivals_rose(flat) and not demand_grew(flat)
