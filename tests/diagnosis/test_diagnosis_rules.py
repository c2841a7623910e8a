"""Each cause's rule on generated scenario data in a real chDB store: the fault's cause ranks first with
sensible evidence and onset; healthy runs give no finding; a vLLM-shaped trace gives request-level
findings only."""

from __future__ import annotations

import math

import numpy as np
import pytest
from diag_scenarios import DURATION_S, SCENARIOS, placed

from collector.client import StoreReader
from diagnosis import CAUSES, TimeRange, diagnose
from diagnosis import facts as F
from diagnosis.config import DiagnosisConfig

FAULTS = [name for name, (_, cause) in SCENARIOS.items() if cause and not name.startswith("vllm")]
# No finding over the whole window, `unexplained` against their first half given as the baseline.
AGAINST_FIRST_HALF = ("bunched_arrivals", "tails_on_a_quiet_host")
HEALTHY = [name for name, (_, cause) in SCENARIOS.items() if cause is None and name not in AGAINST_FIRST_HALF]


def whole(name: str) -> TimeRange:
    cfg = placed(name)
    return TimeRange(cfg.t0, cfg.t0 + DURATION_S)


def halves(name: str) -> tuple[TimeRange, TimeRange]:
    cfg = placed(name)
    mid = cfg.t0 + DURATION_S / 2
    return TimeRange(cfg.t0, mid), TimeRange(mid, cfg.t0 + DURATION_S)


FLEET_CAUSES = {"routing_imbalance", "cache_affinity_lost", "lost_capacity"}  # need several instances


def test_every_cause_has_a_scenario() -> None:
    assert {SCENARIOS[name][1] for name in FAULTS} | {"unexplained"} == set(CAUSES) - FLEET_CAUSES


@pytest.mark.parametrize("name", FAULTS)
def test_the_fault_is_the_top_finding_without_a_baseline(scenario_source: StoreReader, name: str) -> None:
    result = diagnose(scenario_source, window=whole(name)).to_json()
    assert result["regressions"], "the fault must regress a symptom"
    top = result["findings"][0]
    assert top["cause"] == SCENARIOS[name][1]
    assert 0 < top["confidence"] <= 1 and top["symptoms"] and top["lever"]
    assert all({"metric", "baseline", "current"} <= set(e) for e in top["evidence"])
    fault_at = placed(name).t0 + DURATION_S / 2
    assert abs(top["onset"] - fault_at) <= 15, "the onset is found near the fault"
    assert abs(result["window"]["from"] - fault_at) <= 15, "the change point is found near the fault"


@pytest.mark.parametrize("name", FAULTS)
def test_the_fault_is_the_top_finding_with_a_given_baseline(scenario_source: StoreReader, name: str) -> None:
    before, after = halves(name)
    result = diagnose(scenario_source, window=after, baseline=before).to_json()
    assert result["findings"][0]["cause"] == SCENARIOS[name][1]
    assert result["baseline"]["source"] == "given"
    rows = scenario_source.query(result["findings"][0]["sql"]).rows  # the evidence query runs as printed
    assert rows


def test_a_baseline_past_the_onset_still_sees_the_raised_limit(scenario_source: StoreReader) -> None:
    """A change point a few seconds late puts some steps at the new max_num_seqs in the baseline."""
    before, after = halves("oversized_batch")
    late = before.end + 4
    result = diagnose(
        scenario_source, window=TimeRange(late, after.end), baseline=TimeRange(before.start, late)
    ).to_json()
    top = result["findings"][0]
    assert top["cause"] == "oversized_batch"
    limit = next(e for e in top["evidence"] if e["metric"] == "max_num_seqs")
    assert limit["baseline"] < 8 < limit["current"]


def test_a_bigger_batch_s_own_rpc_delay_is_not_blamed_on_the_channel(scenario_source: StoreReader) -> None:
    """Bigger batches make bigger output frames (the RPC delay per token grows a little): that small part
    of the TPOT change must not become an rpc_overhead finding."""
    for baseline in (None, halves("oversized_batch")[0]):
        window = whole("oversized_batch") if baseline is None else halves("oversized_batch")[1]
        causes = [f.cause for f in diagnose(scenario_source, window=window, baseline=baseline).findings]
        assert causes[0] == "oversized_batch" and "rpc_overhead" not in causes


def test_evidence_says_what_moved(scenario_source: StoreReader) -> None:
    before, after = halves("prefix_cache_miss")
    finding = diagnose(scenario_source, window=after, baseline=before).findings[0]
    evidence = {e.metric: e for e in finding.evidence}
    share = evidence["cached_token_share"]
    assert share.current < share.baseline - 0.15
    keys = evidence["prefix_keys_per_request"]
    assert keys.current > keys.baseline
    lengths = evidence["input_tokens_mean"]
    assert abs(lengths.current / lengths.baseline - 1) < 0.2


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_runs_give_no_finding(scenario_source: StoreReader, name: str) -> None:
    assert diagnose(scenario_source, window=whole(name)).findings == ()
    before, after = halves(name)
    assert diagnose(scenario_source, window=after, baseline=before).findings == ()
    assert diagnose(scenario_source, window=before, baseline=after).findings == ()


def test_a_busier_spell_of_the_same_demand_regresses_and_the_load_explains_it(
    scenario_source: StoreReader,
) -> None:
    result = diagnose(scenario_source, window=whole("healthy_busier_spell")).to_json()
    assert {r["metric"] for r in result["regressions"]} & {"ttft_p50", "tpot_p50", "tpot_p99"}
    assert result["findings"] == []
    assert any("busier spell of the same demand" in note for note in result["notes"])


def test_a_busier_host_explains_a_slowdown_short_of_compute_slowdown_only_past_its_cores(
    scenario_source: StoreReader,
) -> None:
    busy = diagnose(scenario_source, window=whole("healthy_busier_host")).to_json()
    assert {r["metric"] for r in busy["regressions"]} & {"ttft_p50", "tpot_p50"}
    assert busy["findings"] == []
    note = next(n for n in busy["notes"] if "busier host" in n)
    assert "short of a compute slowdown" in note
    # the same slowdown where the host had cores to spare: nothing explains it
    quiet = diagnose(scenario_source, window=whole("slower_on_a_quiet_host")).to_json()
    assert [f["cause"] for f in quiet["findings"]] == ["unexplained"]
    assert not any("busier host" in n for n in quiet["notes"])


def test_tails_that_move_on_a_host_past_its_cores_throughout_are_the_hosts_only_there(
    scenario_source: StoreReader,
) -> None:
    # the first half given as the baseline (over the whole window the tails' backlog reads as a busier spell)
    before, after = halves("tails_on_an_oversubscribed_host")
    busy = diagnose(scenario_source, window=after, baseline=before).to_json()
    regressed = {r["metric"] for r in busy["regressions"]}
    assert regressed and all(m.endswith("_p99") for m in regressed)  # tails only, no median
    assert busy["findings"] == []
    assert any("only latency tails moved" in n for n in busy["notes"])
    before, after = halves("tails_on_a_quiet_host")
    quiet = diagnose(scenario_source, window=after, baseline=before).to_json()
    assert {r["metric"] for r in quiet["regressions"]} & regressed
    assert [f["cause"] for f in quiet["findings"]] == ["unexplained"]
    assert not any("only latency tails moved" in n for n in quiet["notes"])


def test_arrivals_bunching_at_the_same_count_is_the_loads_doing_not_unexplained(
    scenario_source: StoreReader,
) -> None:
    result = diagnose(scenario_source, window=whole("bunched_arrivals")).to_json()
    assert {r["metric"] for r in result["regressions"]} & {"ttft_p50", "ttft_p99"}
    assert result["findings"] == []
    note = next(n for n in result["notes"] if "busier spell of the same demand" in n)
    assert "arrivals x0.98" in note


def test_vllm_shaped_trace_gives_request_level_findings_only(scenario_source: StoreReader) -> None:
    before, after = halves("vllm_overload")
    result = diagnose(scenario_source, window=after, baseline=before).to_json()
    assert {"ttft_p50", "ttft_p99"} <= {r["metric"] for r in result["regressions"]}
    assert result["findings"][0]["cause"] == "queueing_overload"
    assert {f["cause"] for f in result["findings"]} <= {
        "queueing_overload",
        "long_prompts",
        "prefix_cache_miss",
    }
    split = result["decomposition"]["ttft"]
    assert split["available"] and split["mean"]["share"]["queue"] > 0.8
    assert result["decomposition"]["step_period"]["available"] is False
    lacking = {n["cause"] for n in result["not_enough_data"]}
    assert {"oversized_batch", "kv_cache_pressure", "prefill_interference", "scheduler_stall"} <= lacking
    assert {"weight_quant_off", "rpc_overhead"} <= lacking


def test_decomposition_adds_up(scenario_source: StoreReader) -> None:
    before, after = halves("oversized_batch")
    period = diagnose(scenario_source, window=after, baseline=before).decomposition["step_period"]
    parts = sum(v for k, v in period["delta"].items() if k != "period")
    assert math.isclose(parts, period["delta"]["period"], rel_tol=1e-6)
    assert period["share"]["batch_size"] > 0.5


def test_an_empty_window_says_so(scenario_source: StoreReader) -> None:
    result = diagnose(scenario_source, window=TimeRange(1_000_000_000, 1_000_000_100))
    assert result.findings == () and result.notes == ("no requests in the window",)


@pytest.mark.parametrize(
    "name", ["compute_slowdown", "long_outputs", "batch_limit_low", "frontend_bottleneck"]
)
def test_with_its_rule_switched_off_a_fault_is_unexplained_not_another_cause(
    scenario_source: StoreReader, name: str
) -> None:
    cause = SCENARIOS[name][1]
    result = diagnose(scenario_source, window=whole(name), without_rules=(cause,)).to_json()
    assert [f["cause"] for f in result["findings"]] == ["unexplained"]
    finding = result["findings"][0]
    assert 0 < finding["confidence"] <= 1 and "stepscope query" in finding["lever"]
    assert any(e["metric"].startswith("series.") for e in finding["evidence"]), "the series that moved"


@pytest.mark.parametrize(
    ("name", "kind"), [("compute_slowdown", "contention"), ("compute_slowdown_clocks", "slower_compute")]
)
def test_compute_slowdown_says_contention_or_slower_compute(
    scenario_source: StoreReader, name: str, kind: str
) -> None:
    before, after = halves(name)
    finding = diagnose(scenario_source, window=after, baseline=before).findings[0]
    evidence = {e.metric: e for e in finding.evidence}
    assert finding.cause == "compute_slowdown" and evidence["slowdown_kind"].current == kind
    assert kind.replace("_", " ") in finding.summary


@pytest.mark.parametrize(
    ("name", "cause", "own_part"),
    [
        ("compute_slowdown_falls_behind", "compute_slowdown", "equal_batch_step_time"),
        ("scheduler_stall_falls_behind", "scheduler_stall", "gaps"),
    ],
)
def test_a_cause_that_falls_behind_its_arrivals_explains_the_fuller_batch_and_queue_that_follow(
    scenario_source: StoreReader, name: str, cause: str, own_part: str
) -> None:
    before, after = halves(name)
    result = diagnose(scenario_source, window=after, baseline=before)
    top = result.findings[0]
    period = result.decomposition["step_period"]["share"]
    assert period["batch_size"] > 0.3, "the batch grew: part of the step period is the fuller batch"
    assert period[own_part] < 0.9, "the cause's own part alone explains too little"
    assert top.cause == cause and top.share_explained >= 0.9


def test_steps_waiting_for_a_core_the_engine_itself_took_are_not_a_compute_slowdown(
    scenario_source: StoreReader,
) -> None:
    before, after = halves("rpc_overhead_own_cpu")
    result = diagnose(scenario_source, window=after, baseline=before)
    assert result.decomposition["step_period"]["equal_batch_ratio"] >= 1.2  # the steps did slow down
    assert result.findings[0].cause == "rpc_overhead"
    assert "compute_slowdown" not in {f.cause for f in result.findings}


def test_a_flat_arrival_ttft_rise_in_a_request_only_trace_is_not_overload(
    scenario_source: StoreReader,
) -> None:
    result = diagnose(scenario_source, window=whole("vllm_slower_steps")).to_json()
    assert result["regressions"]
    assert [f["cause"] for f in result["findings"]] == ["unexplained"]


@pytest.mark.parametrize("name", ["queueing_overload", "scheduler_stall"])
def test_sampled_and_unsampled_runs_give_the_same_top_cause(scenario_source: StoreReader, name: str) -> None:
    causes = [diagnose(scenario_source, window=whole(n)).findings[0].cause for n in (name, f"sampled_{name}")]
    assert causes == [name, name]
    sampled = diagnose(scenario_source, window=whole(f"sampled_{name}")).to_json()
    rates = sampled["data"]["requests"]
    assert rates["baseline"] < rates["current"] or name != "queueing_overload"


def test_the_onset_of_each_finding_lands_within_10_s(scenario_source: StoreReader) -> None:
    for name in FAULTS:
        top = diagnose(scenario_source, window=whole(name)).findings[0]
        assert abs(top.onset - (placed(name).t0 + DURATION_S / 2)) <= 10, name


def test_a_noisy_heavy_tailed_series_keeps_its_onset_at_the_shift() -> None:
    """Mean prompt tokens per second of a real run, prompts made longer from interval 27 (a few requests
    a second, a long tail after): the smallest intervals span 10x the largest by chance. The onset is the
    shift, not the dip 21 s earlier that a log scale makes the sharpest change."""
    means = [486, 217, 262, 89, 169, 84, 446, 458, 364, 298, 508, math.nan, 348, 430, 170, math.nan, 444,
             454, math.nan, 242, 72, 368, 444, math.nan, 478, 549, 185, 303, 865, 366, 1322, 649, 387, 1945,
             333, 334, 309, 676, 644, 152, 246]  # fmt: skip
    series = F.Series(0.0, 1.0, {"input_mean": np.array(means, dtype=float)})
    cfg = DiagnosisConfig(onset_search_s=30.0)
    facts = F.Facts(TimeRange(27.0, 41.0), TimeRange(0.0, 27.0), ({}, {}), ({}, {}), None, [], series, cfg)
    assert abs(facts.onset("input_mean") - 27.0) <= 3


def test_an_onset_from_several_series_is_the_split_they_share() -> None:
    """Prompt lengths per second: the mean of a bimodal mix jumps with whichever requests a second holds
    (here a spurious step 9 s early), while the log of the part the engine prefills steps at the shift.
    `long_prompts` votes with both: the shared split lands at the shift."""
    rng = np.random.default_rng(5)
    t = np.arange(60)
    prefilled = np.where(t < 40, 4.4, 5.0) + rng.normal(0, 0.3, 60)
    means = np.where(t < 31, 250.0, 380.0) + rng.normal(0, 120, 60)
    series = F.Series(0.0, 1.0, {"input_mean": means, "uncached_log_mean": prefilled})
    facts = F.Facts(TimeRange(40.0, 60.0), TimeRange(0.0, 40.0), ({}, {}), ({}, {}), None, [], series,
                    DiagnosisConfig())  # fmt: skip
    assert abs(facts.onset("input_mean") - 31.0) <= 1
    assert abs(facts.onset(("input_mean", "uncached_log_mean")) - 40.0) <= 1


def test_too_few_requests_a_side_is_said_not_passed_over(scenario_source: StoreReader) -> None:
    cfg = placed("scheduler_stall")
    mid = cfg.t0 + DURATION_S / 2
    short = diagnose(scenario_source, window=TimeRange(mid, mid + 4), baseline=TimeRange(mid - 4, mid))
    assert not short.regressions and "no latency percentile was tested" in " ".join(short.notes)
    full = diagnose(scenario_source, window=whole("scheduler_stall"))
    assert not any("was tested" in n or "were not tested" in n for n in full.notes)


def test_a_request_in_flight_at_the_split_is_not_part_of_the_baselines_latency(
    scenario_source: StoreReader,
) -> None:
    """The requests that started before the split and ended after it were hit by what changed there: the
    baseline's latency quantiles and test sample leave them out, its arrivals still count them."""
    before, after = halves("queueing_overload")
    b, c = F.request_sides(scenario_source, before, after)
    sample_b, _ = F.request_sample(scenario_source, before, after, b["requests"], c["requests"], 100_000)
    params = {"b0": before.start_ns, "b1": before.end_ns}
    started, ended = scenario_source.query(
        "SELECT count(), countIf(end_time < fromUnixTimestamp64Nano({b1:Int64})) FROM requests "
        "WHERE time >= fromUnixTimestamp64Nano({b0:Int64}) AND time < fromUnixTimestamp64Nano({b1:Int64})",
        params,
    ).rows[0]
    assert started > ended, "the scenario has requests in flight at the split"
    assert b["requests"] == started and len(sample_b["ttft_s"]) == ended
    assert b["e2e_p99"] <= max(sample_b["e2e_s"]), "no request in flight at the split sets the baseline's P99"
