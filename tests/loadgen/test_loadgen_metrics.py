"""Percentiles, goodput, SLO attainment and the fluidity index on hand-made samples."""

import pytest

from loadgen.client import RequestRecord
from loadgen.metrics import (
    SLO,
    fluidity,
    fluidity_index,
    goodput,
    meets_slo,
    percentiles,
    slo_attainment,
    step_figures,
)


def rec(
    ttft: float, token_gaps: list[float], send: float = 0.0, error: str | None = None, tokens=None
) -> RequestRecord:
    """A completed request sent at `send`, first token `ttft` later, then tokens at `token_gaps`."""
    r = RequestRecord(
        index=0, kind="chat", max_tokens=16, prompt_tokens_est=10, scheduled_s=send, send_s=send
    )
    if error:
        r.error = error
        return r
    t = send + ttft
    r.first_token_s = t
    r.token_times_s = [t]
    for g in token_gaps:
        t += g
        r.token_times_s.append(t)
    r.end_s = t
    r.output_tokens = len(r.token_times_s) if tokens is None else tokens
    return r


def test_percentiles_interpolate_linearly():
    p = percentiles([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert p["p50"] == pytest.approx(5.5)
    assert p["p90"] == pytest.approx(9.1)
    assert p["p99"] == pytest.approx(9.91)
    assert p["mean"] == pytest.approx(5.5)


def test_percentiles_of_nothing_are_none_and_nones_are_skipped():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert percentiles([None, 2.0])["p99"] == 2.0


def test_ttft_tpot_e2e_and_itl_follow_their_definitions():
    r = rec(0.5, [0.1, 0.2, 0.3], send=2.0)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx(0.6 / 3)  # (E2E - TTFT) / (tokens - 1)
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_uses_usage_tokens_when_chunks_carry_several():
    r = rec(0.5, [0.4], tokens=5)  # 2 chunks, 5 tokens by usage
    assert r.tpot_s == pytest.approx(0.4 / 4)


def test_goodput_counts_requests_meeting_both_slos_per_second():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [
        rec(0.5, [0.05, 0.05]),  # meets both
        rec(0.9, [0.09, 0.1]),  # meets both (TTFT near the limit)
        rec(1.5, [0.05]),  # TTFT miss
        rec(0.2, [0.3, 0.3]),  # TPOT miss
        rec(0.2, [], tokens=1),  # one token: no TPOT, passes that half
        rec(0, [], error="http_5xx"),  # failures miss
    ]
    assert [meets_slo(r, slo) for r in records] == [True, True, False, False, True, False]
    assert goodput(records, slo, elapsed_s=2.0) == pytest.approx(1.5)
    assert slo_attainment(records, slo) == pytest.approx(3 / 6)


def test_unset_slos_always_pass_and_attainment_of_nothing_is_none():
    assert meets_slo(rec(100.0, [50.0]), SLO())
    assert slo_attainment([], SLO(ttft_s=1.0)) is None


def test_fluidity_banks_slack_from_early_tokens():
    # prefill deadline 1.0, decode 0.1: first token 0.5 early, so a later 0.5 s stall is absorbed
    assert fluidity([0.5, 0.1, 0.5, 0.1], 1.0, 0.1) == (4, 4)


def test_fluidity_counts_every_deadline_a_stall_overran_then_resets():
    # no slack: a 0.35 s gap overruns deadlines at 0.1, 0.2 and 0.3 -> 3 misses; the schedule restarts
    met, total = fluidity([1.0, 0.1, 0.35, 0.1], 1.0, 0.1)
    assert (met, total) == (3, 6)
    # a late first token misses its own deadline and every decode deadline it overran
    assert fluidity([1.25, 0.1], 1.0, 0.1) == (1, 4)


def test_an_early_stall_hurts_fluidity_more_than_a_late_one():
    early = fluidity([0.2, 0.3] + [0.05] * 8, 0.2, 0.1)
    late = fluidity([0.2] + [0.05] * 8 + [0.3], 0.2, 0.1)
    assert early[0] / early[1] < late[0] / late[1] == 1.0


def test_fluidity_index_pools_deadlines_over_completed_requests_and_needs_both_slos():
    # the second request: slack 0.1 + 0.01, then a 0.35 s stall overruns 2 deadlines -> 3 met of 5
    records = [rec(0.5, [0.09, 0.09]), rec(0.9, [0.09, 0.35, 0.09]), rec(0, [], error="timeout")]
    assert fluidity_index(records, SLO(ttft_s=1.0, tpot_s=0.1)) == pytest.approx((3 + 3) / (3 + 5))
    assert fluidity_index(records, SLO(ttft_s=1.0)) is None


def test_step_figures_count_throughput_and_errors_by_kind():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [
        rec(0.5, [0.05] * 9),
        rec(0.5, [0.05] * 9),
        rec(0, [], error="timeout"),
        rec(0, [], error="http_429"),
    ]
    f = step_figures(records, elapsed_s=4.0, slo=slo)
    assert f["num_requests"] == 4 and f["completed"] == 2
    assert f["errors"] == {"http_429": 1, "timeout": 1}
    assert f["error_rate"] == 0.5
    assert f["request_throughput_rps"] == pytest.approx(0.5)
    assert f["output_token_throughput_tps"] == pytest.approx(20 / 4)
    assert f["goodput_rps"] == pytest.approx(0.5)
    assert f["slo_attainment"] == pytest.approx(0.5)
    assert f["ttft_s"]["p99"] == pytest.approx(0.5)
    assert f["tpot_s"]["p50"] == pytest.approx(0.05)
    assert f["itl_s"]["p90"] == pytest.approx(0.05)
    assert f["fluidity_index"] == 1.0


def test_slo_refuses_nonsense():
    with pytest.raises(ValueError):
        SLO(ttft_s=0.0)
    with pytest.raises(ValueError):
        SLO(target=1.5)


def test_rates_count_only_what_finished_inside_the_window_and_latencies_count_everything():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    inside = rec(0.5, [0.05] * 9, send=0.0)  # ends at 0.95
    straddling = rec(0.5, [0.05] * 9, send=9.5)  # tokens at 10.0 .. 10.4: 1 of 10 inside a 10 s window
    f = step_figures([inside, straddling], elapsed_s=12.0, slo=slo, window_s=10.0)
    assert f["duration_s"] == 10.0 and f["elapsed_s"] == 12.0
    assert f["completed"] == 2 and f["completed_in_window"] == 1
    assert f["request_throughput_rps"] == pytest.approx(0.1)
    assert f["goodput_rps"] == pytest.approx(0.1)
    assert f["output_token_throughput_tps"] == pytest.approx((10 + 1) / 10.0)
    assert f["slo_attainment"] == 1.0 and f["e2e_s"]["p50"] == pytest.approx(0.95)
