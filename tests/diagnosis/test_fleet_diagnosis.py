"""Diagnosis across instances on generated fleets: three simulated replicas in one store, a fault on one of
them or on all; the findings say where (diagnosis/fleet.py)."""

from __future__ import annotations

import dataclasses

import pytest
from diag_simulate import SimConfig, write

from collector.client import StoreReader
from collector.store import Store
from collector.timerange import TimeRange
from diagnosis import diagnose
from diagnosis.config import DiagnosisConfig
from diagnosis.fleet import ScopedReader, stopped_at

IDS = ("r0", "r1", "r2")
HOUR = 3600.0
# 24 tenants' system prompts (512 tokens, 32 blocks each); a replica's prefix cache holds 8 of them
TENANTS = tuple(range(24))
SHARED = {"shared_fraction": 0.5, "prefix_cache_blocks": 8 * 32}
SWINGS = ((10.0, 30.0, 30.0), (45.0, 60.0, 40.0), (75.0, 95.0, 30.0), (105.0, 115.0, 20.0))


def _fleet(t0: float, faults: dict[str, dict], **per: dict) -> list[SimConfig]:
    base = SimConfig(t0=SimConfig.t0 + t0, rate_rps=3.0, duration_s=240.0, fault_at_s=120.0)
    out = []
    for i, name in enumerate(IDS):
        cfg = dataclasses.replace(base, seed=11 + i, instance=name, fault=faults.get(name, {}))
        out.append(dataclasses.replace(cfg, **per.get(name, {})))
    return out


CASES = {
    "one_stalled": _fleet(0, {"r0": {"stall_ms": 120.0}}),
    "all_stalled": _fleet(HOUR, {n: {"stall_ms": 120.0} for n in IDS}),
    "skewed": _fleet(2 * HOUR, {"r0": {"rate_rps": 6.5}, "r1": {"rate_rps": 1.25}, "r2": {"rate_rps": 1.25}}),
    # r0 held to a share of the CPU: its steps wait; routing sends it less, and its peers, given the cores
    # it left, speed up. The fleet's percentiles hold; r0's own regress.
    "diluted": _fleet(
        4 * HOUR,
        {
            "r0": {"cpu_wait_factor": 1.6, "rate_rps": 1.5},
            "r1": {"clock_factor": 0.6, "rate_rps": 3.75},
            "r2": {"clock_factor": 0.6, "rate_rps": 3.75},
        },
    ),
    # The host was busy in the first half (every replica's loop waited for a core between steps, together,
    # in four bursts), calm in the second, when r0 was held to a share of the CPU and routing sent it less:
    # against its own swinging baseline r0's latency shows no significant rise, against its peers' in the
    # same moments it does.
    "diluted_on_a_swinging_host": _fleet(
        7 * HOUR,
        {"r0": {"cpu_wait_factor": 1.8, "rate_rps": 2.0}, "r1": {"rate_rps": 3.5}, "r2": {"rate_rps": 3.5}},
        **{n: {"host_swings": SWINGS} for n in IDS},
    ),
    "lost": _fleet(3 * HOUR, {"r0": {"rate_rps": 4.5}, "r1": {"rate_rps": 4.5}}, r2={"duration_s": 120.0}),
    # r2 stops at 170 s and its peers, far from their capacity, absorb its share: no latency moves, so a
    # change point over the symptoms has nothing to find.
    "lost_unnoticed": _fleet(9 * HOUR, {}, r2={"duration_s": 170.0}),
    # Routed by prefix, each replica receives 8 tenants, whose prefixes its cache holds; then routing stops
    # looking at the prefix: every replica receives all 24 and its cache, evicting, misses most of them.
    "scattered": _fleet(
        5 * HOUR,
        {n: {"tenants": TENANTS} for n in IDS},
        **{n: SHARED | {"tenants": TENANTS[i::3]} for i, n in enumerate(IDS)},
    ),
    # The same, with r2 taking the router's overflow before: few shared prompts, little reuse to lose.
    "scattered_overflow": _fleet(
        6 * HOUR,
        {n: {"tenants": TENANTS} for n in IDS},
        **{n: SHARED | {"tenants": TENANTS[i::3]} for i, n in enumerate(IDS[:2])},
        r2=SHARED | {"shared_fraction": 0.05, "tenants": TENANTS},
    ),
    # The same, r2 having reused nothing before (the overflow of prompts whose prefixes it never held):
    # scattered, the shared prompts bring its cache some reuse.
    "scattered_onto_an_empty_cache": _fleet(
        8 * HOUR,
        {n: {"tenants": TENANTS, "prefix_change_fraction": 0.0} for n in IDS},
        **{n: SHARED | {"tenants": TENANTS[i::3]} for i, n in enumerate(IDS[:2])},
        r2=SHARED | {"tenants": TENANTS, "prefix_change_fraction": 1.0},
    ),
    # Routed by prefix, r2 held the tenants with the most shared prompts (half of them with a prefix of their
    # own); scattered, every replica gets the fleet's mix: r0 and r1 lose their reuse and get longer prompts
    # (x1.4), r2 shorter ones. The fleet's prompts and prefixes are as before; the regression is on r0, r1.
    "scattered_mix_moved": _fleet(
        10 * HOUR,
        {n: {"tenants": TENANTS, "shared_fraction": f} for n, f in zip(IDS, (0.6, 0.6, 0.3), strict=True)},
        **{n: SHARED | {"tenants": TENANTS[i::3], "shared_fraction": 0.35} for i, n in enumerate(IDS[:2])},
        r2=SHARED | {"tenants": TENANTS[2::3], "shared_fraction": 0.8, "prefix_change_fraction": 0.5},
    ),
    # Scattered as in "scattered", while the router sends r0 half its traffic and r1, r2 sped up (clocks
    # restored): the fleet's percentiles hold, r0's TTFT rises. From r0 alone it looks like changed prompts
    # (prefixes it never held); the fleet's keys per request say the prompts are the same, scattered.
    "scattered_surfacing_on_one": _fleet(
        11 * HOUR,
        {
            "r0": {"tenants": TENANTS, "rate_rps": 1.5},
            "r1": {"tenants": TENANTS, "clock_factor": 0.4},
            "r2": {"tenants": TENANTS, "clock_factor": 0.4},
        },
        **{n: SHARED | {"tenants": TENANTS[i::3]} for i, n in enumerate(IDS)},
    ),
    # The router sends r0 5 of every 9 requests (was 3), its peers 2 each, sped up: the fleet's arrivals and
    # percentiles hold, r0 queues. From r0 alone it looks like more load; the fleet's says a skew.
    "skew_surfacing_on_one": _fleet(
        12 * HOUR,
        {
            "r0": {"rate_rps": 5.0},
            "r1": {"rate_rps": 2.0, "clock_factor": 0.6},
            "r2": {"rate_rps": 2.0, "clock_factor": 0.6},
        },
    ),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    store = Store.open(f"chdb://{tmp_path_factory.mktemp('fleet')}")
    for sims in CASES.values():
        for cfg in sims:
            write(store, cfg)
    src = StoreReader(store)
    yield src
    src.close()


def _diagnose(source, case: str, src=None):
    t0 = CASES[case][0].t0
    window = TimeRange(t0 + 120.0, t0 + 240.0)
    return diagnose(src or source, window, baseline=TimeRange(t0, t0 + 120.0)).to_json()


def test_a_fault_on_one_replica_is_named_on_that_instance(source):
    d = _diagnose(source, "one_stalled")
    top = d["findings"][0]
    assert top["cause"] == "scheduler_stall"
    assert top["scope"]["kind"] == "instances" and top["scope"]["instances"] == ["r0"]
    assert top["scope"]["share_of_regression"] >= 0.7


def test_a_fault_on_every_replica_is_fleet_wide(source):
    d = _diagnose(source, "all_stalled")
    assert d["findings"][0]["cause"] == "scheduler_stall"
    assert d["findings"][0]["scope"]["kind"] == "fleet"
    assert d["findings"][0]["scope"]["instances"] == list(IDS)


def test_traffic_pinned_to_one_replica_is_routing_imbalance_there(source):
    d = _diagnose(source, "skewed")
    top = d["findings"][0]
    assert top["cause"] == "routing_imbalance" and top["scope"]["instances"] == ["r0"]


def test_one_replica_regressing_inside_a_steady_fleet_average_is_found_on_it(source):
    d = _diagnose(source, "diluted")
    assert d["notes"][0].startswith("the fleet's symptoms held; r0 regressed on its own")
    assert {"tpot_p50", "ttft_p50"} <= {r["metric"] for r in d["regressions"]}  # r0's own
    top = d["findings"][0]
    assert top["cause"] == "compute_slowdown" and top["scope"]["instances"] == ["r0"]
    assert top["scope"]["kind"] == "instances"
    peers = {e["metric"]: e["current"] for e in top["evidence"]}["step_time_vs_peers_at_equal_batch"]
    assert peers > 2


def test_one_replica_regressing_on_a_host_whose_load_swung_is_found_against_its_peers(source):
    t0 = CASES["diluted_on_a_swinging_host"][0].t0
    d = diagnose(source, TimeRange(t0, t0 + 240.0)).to_json()  # no baseline: change points, as a user runs it
    assert "r0 against its peers in the same time blocks" in d["notes"][0]
    peers = {r["metric"]: r for r in d["regressions"] if r["against"] == "peers"}
    assert peers["tpot_p50"]["ratio"] > 1.5  # r0's TPOT over its peers', current against baseline
    top = d["findings"][0]
    assert top["cause"] == "compute_slowdown" and top["scope"] == {
        "kind": "instances", "instances": ["r0"], "share_of_regression": 1.0,
    }  # fmt: skip


def test_a_replica_that_stopped_serving_is_lost_capacity_on_it(source):
    d = _diagnose(source, "lost")
    top = d["findings"][0]
    assert top["cause"] == "lost_capacity" and top["scope"] == {
        "kind": "instances", "instances": ["r2"], "share_of_regression": pytest.approx(1 / 3, abs=0.05),
    }  # fmt: skip


def test_a_replica_lost_without_a_symptom_is_found_at_its_stop_with_no_baseline_given(source):
    t0 = CASES["lost_unnoticed"][0].t0
    d = diagnose(source, TimeRange(t0, t0 + 240.0)).to_json()  # no baseline: as a user runs it
    assert d["window"]["from"] == pytest.approx(t0 + 170.0, abs=2.0)  # split where r2 went silent
    top = d["findings"][0]
    assert top["cause"] == "lost_capacity" and top["scope"]["instances"] == ["r2"]
    assert abs(top["onset"] - (t0 + 170.0)) <= 10.0


def test_a_lost_replicas_onset_is_its_last_request_whatever_the_windows(source):
    """The fleet's peers absorb the load, so the fleet's request series has no step: the onset is the lost
    instance's last request, not a change point of the fleet's traffic near the windows' split."""
    t0 = CASES["lost_unnoticed"][0].t0
    d = diagnose(source, TimeRange(t0 + 165.0, t0 + 240.0), baseline=TimeRange(t0, t0 + 165.0)).to_json()
    top = d["findings"][0]
    assert top["cause"] == "lost_capacity" and top["scope"]["instances"] == ["r2"]
    last = (
        "SELECT max(toUnixTimestamp64Nano(time)) / 1e9 FROM requests"
        " WHERE instance = 'r2' AND time < toDateTime64({t:Float64}, 9)"
    )
    assert top["onset"] == pytest.approx(source.query(last, {"t": t0 + 240.0}).rows[0][0], abs=0.01)
    assert top["onset"] == pytest.approx(t0 + 170.0, abs=1.0)


def test_no_instance_stopped_in_a_fleet_that_kept_serving(source):
    t0 = CASES["one_stalled"][0].t0
    assert stopped_at(source, TimeRange(t0, t0 + 240.0), DiagnosisConfig()) is None
    t0 = CASES["lost_unnoticed"][0].t0
    assert stopped_at(source, TimeRange(t0, t0 + 240.0), DiagnosisConfig()) == pytest.approx(
        t0 + 170.0, abs=1.0
    )


def test_shared_prompts_scattered_over_every_replica_is_cache_affinity_lost_fleet_wide(source):
    d = _diagnose(source, "scattered")
    top = d["findings"][0]
    assert top["cause"] == "cache_affinity_lost"
    assert top["scope"]["kind"] == "fleet" and top["scope"]["instances"] == list(IDS)
    ev = {e["metric"]: (e["baseline"], e["current"]) for e in top["evidence"]}
    assert ev["instances_per_shared_prefix"] == (pytest.approx(1.0), pytest.approx(3.0, abs=0.1))
    # a repeated prefix went where it went last; scattered over three replicas, about a third of the time
    assert ev["prefix_affinity_share"] == (pytest.approx(1.0), pytest.approx(1 / 3, abs=0.1))
    for key in ["cached_token_share"] + [f"cached_token_share[{n}]" for n in IDS]:
        before, now = ev[key]
        assert before > 0.6 and before - now > 0.3, key  # every replica's cache reuse fell
    assert ev["prefix_keys_per_request"][1] == pytest.approx(ev["prefix_keys_per_request"][0], rel=0.1)
    assert ev["input_tokens_mean"][1] == pytest.approx(ev["input_tokens_mean"][0], rel=0.1)
    assert "prefix_cache_miss" not in {f["cause"] for f in d["findings"]}
    assert d["decomposition"]["ttft"]["mean"]["share"]["prefill"] > 0.8  # the misses' prefill is the rise


@pytest.mark.parametrize("case", ["scattered_overflow", "scattered_onto_an_empty_cache"])
def test_scattered_prompts_with_one_replica_that_held_little_reuse_is_still_cache_affinity_lost(source, case):
    d = _diagnose(source, case)
    top = d["findings"][0]
    assert top["cause"] == "cache_affinity_lost" and {"r0", "r1"} <= set(top["scope"]["instances"])
    ev = {e["metric"]: (e["baseline"], e["current"]) for e in top["evidence"]}
    assert ev["cached_token_share[r2]"][0] < 0.2  # nothing to lose there; r0 and r1 lost theirs
    assert "prefix_cache_miss" not in {f["cause"] for f in d["findings"]}


def test_scattered_prompts_that_moved_the_regressed_replicas_prompt_mix_are_cache_affinity_lost(source):
    """The regression sits on the replicas that held the reuse, whose prompts also grew when the router
    stopped sorting them: the same prompts are judged on the fleet, and the router's cause is the fleet's."""
    d = _diagnose(source, "scattered_mix_moved")
    top = d["findings"][0]
    assert top["cause"] == "cache_affinity_lost"
    assert top["scope"]["kind"] == "fleet" and top["scope"]["instances"] == list(IDS)
    ev = {e["metric"]: (e["baseline"], e["current"]) for e in top["evidence"]}
    assert ev["input_tokens_mean"][1] == pytest.approx(ev["input_tokens_mean"][0], rel=0.1)  # the fleet's
    t0 = CASES["scattered_mix_moved"][0].t0
    regressed = ScopedReader(source, instances=["r0", "r1"])
    mean = "SELECT avg(input_tokens) AS m FROM requests WHERE time {} toDateTime64({{t:Float64}}, 9)"
    before, after = (regressed.query(mean.format(op), {"t": t0 + 120.0}).rows[0][0] for op in "<>")
    assert after / before > 1.25  # the regressed replicas' own prompts grew past steady_prompt_ratio
    causes = {f["cause"] for f in d["findings"]}
    assert causes.isdisjoint({"long_prompts", "prefix_cache_miss", "unexplained"})


@pytest.mark.parametrize(
    ("case", "cause", "look_alike", "scope"),
    [
        ("scattered_surfacing_on_one", "cache_affinity_lost", "prefix_cache_miss", list(IDS)),
        ("skew_surfacing_on_one", "routing_imbalance", "queueing_overload", ["r0"]),
    ],
)
def test_a_routers_cause_surfacing_on_one_replica_is_named_from_the_fleets_evidence(
    source, case, cause, look_alike, scope
):
    """One replica regressed on its own; what it sees alone looks like another cause, and the fleet's
    evidence in the same windows names the router."""
    d = _diagnose(source, case)
    assert d["notes"][0].startswith("the fleet's symptoms held; r0 regressed on its own")
    assert "the fleet's router evidence in r0's windows explains it" in d["notes"][0]
    top = d["findings"][0]
    assert top["cause"] == cause and top["scope"]["instances"] == scope
    assert {f["cause"] for f in d["findings"]}.isdisjoint({look_alike, "unexplained"})
    t0 = CASES[case][0].t0
    whole = diagnose(source, TimeRange(t0, t0 + 240.0)).to_json()  # no baseline given: the change point's
    assert whole["findings"][0]["cause"] == cause


def test_the_instance_filter_diagnoses_one_healthy_replica_as_healthy(source):
    d = _diagnose(source, "one_stalled", ScopedReader(source, instances=["r1"]))
    assert d["findings"] == []
