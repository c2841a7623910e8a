"""Knee detection, recommendation, cost, and the results.json / plots / table built from step records."""

import json

import pytest

from loadgen.bench import BenchConfig, build_results
from loadgen.client import RequestRecord
from loadgen.knee import KneeConfig, cost_per_1k_requests, find_knee, recommended_load, throughput_at
from loadgen.metrics import SLO
from loadgen.report import table, write_json, write_plots
from loadgen.runner import RunResult
from loadgen.workloads import Workload


def step(ttft_p99: float, tpot_p99: float = 0.02, attainment: float = 1.0, error_rate: float = 0.0) -> dict:
    return {
        "ttft_s": {"p50": ttft_p99, "p90": ttft_p99, "p99": ttft_p99},
        "tpot_s": {"p50": tpot_p99, "p90": tpot_p99, "p99": tpot_p99},
        "slo_attainment": attainment,
        "error_rate": error_rate,
    }


SLO_SET = SLO(ttft_s=2.0, tpot_s=0.2, target=0.9)


def test_a_steep_p99_ttft_rise_is_the_knee():
    loads = [1, 2, 4, 8, 16]
    steps = [step(0.10), step(0.11), step(0.15), step(0.90), step(3.0, attainment=0.5)]
    knee = find_knee(loads, steps, SLO_SET, KneeConfig())
    assert (knee.found, knee.index, knee.load, knee.metric) == (True, 3, 8.0, "ttft_p99")
    assert "TTFT" in knee.reason


def test_a_rise_slower_than_load_is_not_a_knee():
    loads = [1, 2, 4, 8]
    steps = [step(0.10), step(0.14), step(0.19), step(0.26)]  # elasticity ~0.45
    assert not find_knee(loads, steps, SLO_SET, KneeConfig()).found


def test_a_steep_but_immaterial_rise_is_not_a_knee():
    loads = [1, 2, 4]
    steps = [step(0.010), step(0.011), step(0.040)]  # x4 on a x2 load, but +29 ms against a 2 s SLO
    assert not find_knee(loads, steps, SLO_SET, KneeConfig()).found


def test_tpot_rising_as_fast_as_load_is_a_knee():
    loads = [1, 2, 4, 8]
    steps = [step(0.1, 0.02), step(0.1, 0.021), step(0.1, 0.045), step(0.1, 0.09)]
    knee = find_knee(loads, steps, SLO_SET, KneeConfig())
    assert (knee.index, knee.metric) == (2, "tpot_p99")


def test_slo_attainment_below_target_is_a_knee_even_when_latency_is_flat():
    loads = [1, 2, 4]
    steps = [step(1.9), step(1.9, attainment=0.95), step(1.95, attainment=0.85)]
    knee = find_knee(loads, steps, SLO_SET, KneeConfig())
    assert (knee.index, knee.metric) == (2, "slo_attainment")


def test_errors_beyond_the_target_share_are_a_knee_without_slos():
    loads = [1, 2]
    knee = find_knee(loads, [step(0.1), step(0.1, error_rate=0.3)], SLO(), KneeConfig())
    assert (knee.index, knee.metric) == (1, "error_rate")


def test_recommendation_keeps_20_percent_headroom_below_the_knee():
    cfg = KneeConfig()
    loads = [1, 2, 4, 8]
    knee = find_knee(loads, [step(0.1), step(0.1), step(0.1), step(5.0)], SLO_SET, cfg)
    assert recommended_load(loads, knee, cfg) == pytest.approx(0.8 * 4)


def test_no_knee_recommends_below_the_highest_tested_load_and_a_first_step_knee_recommends_nothing():
    cfg = KneeConfig()
    loads = [1, 2]
    none = find_knee(loads, [step(0.1), step(0.1)], SLO_SET, cfg)
    assert none.reason == "no knee within the tested range"
    assert recommended_load(loads, none, cfg) == pytest.approx(1.6)
    first = find_knee(loads, [step(0.1, attainment=0.2), step(0.1)], SLO_SET, cfg)
    assert first.index == 0 and recommended_load(loads, first, cfg) is None


def test_throughput_is_interpolated_between_tested_loads_and_the_origin():
    assert throughput_at([1, 2, 4], [1.0, 1.8, 3.0], 3.2) == pytest.approx(1.8 + 0.6 * 1.2)
    assert throughput_at([2, 4], [2.0, 3.0], 1.0) == pytest.approx(1.0)


def test_cost_per_1k_requests():
    # 2 $/h at 0.5 req/s: 1800 requests an hour -> 1000 requests cost 1.111 $
    assert cost_per_1k_requests(2.0, 0.5) == pytest.approx(2.0 / 1800 * 1000)
    assert cost_per_1k_requests(2.0, 0.0) is None


def _records(n: int, ttft: float, gap: float, tokens: int = 10) -> list[RequestRecord]:
    out = []
    for i in range(n):
        r = RequestRecord(i, "chat", tokens, 50, scheduled_s=i * 0.1, send_s=i * 0.1)
        r.first_token_s = r.send_s + ttft
        r.token_times_s = [r.first_token_s + k * gap for k in range(tokens)]
        r.end_s = r.token_times_s[-1]
        r.output_tokens = tokens
        out.append(r)
    return out


@pytest.fixture
def bench_results():
    cfg = BenchConfig(
        url="http://x", model="m", workload=Workload.load("mixed"), loads=[1, 2, 4, 8], duration_s=10.0,
        slo=SLO_SET, cost_per_hour=2.0,
    )  # fmt: skip
    runs = [
        RunResult(_records(10, 0.1, 0.02), elapsed_s=10.0),
        RunResult(_records(20, 0.1, 0.02), elapsed_s=10.0),
        RunResult(_records(38, 0.2, 0.03), elapsed_s=10.0),
        RunResult(_records(40, 4.0, 0.05), elapsed_s=10.0),
    ]
    return build_results(cfg, runs)


def test_results_hold_steps_knee_recommendation_and_cost(bench_results):
    r = bench_results
    assert [s["load"] for s in r["steps"]] == [1, 2, 4, 8]
    assert [s["completed"] for s in r["steps"]] == [10, 20, 38, 40]
    assert r["knee"]["found"] and r["knee"]["load"] == 8
    assert r["recommended_load"] == pytest.approx(3.2) and r["recommended_concurrency"] == 3
    thr = 2.0 + (3.8 - 2.0) * 0.6  # interpolated at 3.2 between (2, 2.0) and (4, 3.8)
    assert r["cost_per_1k_requests"] == pytest.approx(2.0 / (thr * 3600) * 1000)
    s = r["steps"][0]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(s[key]) == {"p50", "p90", "p99", "mean"}
    for key in ("goodput_rps", "slo_attainment", "fluidity_index", "errors", "request_throughput_rps"):
        assert key in s


def test_results_json_plots_and_table_are_written(tmp_path, bench_results):
    out = tmp_path / "run" / "results.json"
    write_json(out, bench_results)
    plots = write_plots(bench_results, out)
    assert json.loads(out.read_text())["knee"]["load"] == 8
    assert [p.name for p in plots] == ["results_throughput.png", "results_latency.png"]
    for p in plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = table(bench_results)
    assert "knee: 8" in text and "recommended concurrency: 3.2" in text and "cost per 1k" in text
    assert len(text.splitlines()) == 2 + 4 + 4


def test_a_run_with_no_completed_step_still_reports(tmp_path):
    cfg = BenchConfig(url="http://x", model="m", workload=Workload.load("chat"), loads=[1, 2], duration_s=1.0)
    failed = RequestRecord(0, "chat", 8, 5, 0.0)
    failed.error = "connection"
    r = build_results(cfg, [RunResult([failed], elapsed_s=1.0)], interrupted=True)
    assert r["steps"][0]["completed"] == 0 and r["steps"][0]["errors"] == {"connection": 1}
    assert r["knee"]["index"] == 0 and r["recommended_load"] is None and r["interrupted"]
    assert "interrupted" in table(r)
    assert len(write_plots(r, tmp_path / "r.json")) == 2


def test_with_few_requests_per_step_a_robust_quantile_stands_in_for_p99():
    def small(p50: float, p99: float) -> dict:
        s = step(p99)
        s["ttft_s"] = {"p50": p50, "p90": p99, "p99": p99}
        s["completed"] = 5
        return s

    loads = [1, 2, 4]
    one_slow_request = [small(0.1, 0.4), small(0.1, 1.5), small(0.12, 1.6)]
    assert not find_knee(loads, one_slow_request, SLO_SET, KneeConfig()).found
    queueing = [small(0.1, 0.4), small(0.1, 0.5), small(0.9, 1.6)]
    knee = find_knee(loads, queueing, SLO_SET, KneeConfig())
    assert (knee.index, knee.metric) == (2, "ttft_p50")
