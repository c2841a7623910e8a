"""The eval's protocol: reproducible draws, dev/holdout splits, healthy runs per workload, --resume and
--rediagnose merging rows, and a summary that counts a known set of rows right. No scenario is run: where
the command would run one, a stand-in writes a made-up row (a real run takes minutes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scenarios import eval as ev
from scenarios import evaldir
from scenarios.config import ScenarioConfig, fault_clients, fault_workload
from scenarios.faults import FAULTS, open_loop, value_range
from scenarios.protocol import (
    LOAD_RANGE,
    ONSET_RANGE,
    Case,
    draw,
    grid,
    healthy_workloads,
    resolve_only,
    split_of,
)
from scenarios.scoring import markdown, percentile, score, summarize
from stepscope import results
from stepscope.cli import main


def test_the_full_grids_draws_are_reproducible_from_each_cases_seed():
    faults = list(FAULTS)
    first, again = grid(faults, "full"), grid(faults, "full")
    assert first == again
    assert draw("overload", 1, 1001, "overload") == next(c for c in first if c.name == "overload-m1-s1001")
    assert draw("overload", 1, 1001, "overload") != draw("overload", 1, 1, "overload")


def test_every_drawn_case_runs_its_own_traffic_so_one_burst_cannot_sink_a_split():
    cases = grid(list(FAULTS), "full")
    seeds = [c.run_seed for c in cases]
    assert len(set(seeds)) == len(cases), "each case draws its own prompts and arrival times"
    base = ScenarioConfig(out=Path("/x"))
    for c in cases[:3]:
        assert ev.case_config(c, base, Path("/x")).seed == c.traffic_seed != c.seed
    # the draws before it are unchanged by it, and a stored case from before it runs its split's seed
    assert Case("overload", 1).run_seed == 1


def test_full_grid_every_fault_at_two_magnitudes_from_its_range_times_a_dev_and_a_holdout_seed():
    cases = grid(list(FAULTS), "full")
    for name, fault in FAULTS.items():
        mine = [c for c in cases if c.fault == name]
        assert sorted((c.split, c.index) for c in mine) == [
            ("dev", 0),
            ("dev", 1),
            ("holdout", 0),
            ("holdout", 1),
        ]
        for c in mine:
            assert ONSET_RANGE[0] <= c.onset_fraction <= ONSET_RANGE[1]
            if open_loop(fault):
                assert LOAD_RANGE[0] <= c.load_fraction <= LOAD_RANGE[1]
            else:
                assert c.load_fraction is None  # closed-loop clients bring the demand
            if value_range(fault) is None:
                assert c.value is None
                continue
            lo, hi = value_range(fault)
            half = (hi - lo) / 2
            assert lo + half * c.index - 0.5 <= c.value <= lo + half * (c.index + 1) + 0.5  # its half
            if all(isinstance(b, int) for b in (lo, hi)):
                assert c.value == int(c.value)
    assert {split_of(c.seed) for c in cases} == {"dev", "holdout"}
    assert all(split_of(c.seed) == ("holdout" if c.seed >= 1000 else "dev") for c in cases)


def test_healthy_runs_cover_every_faults_workload_and_the_default_at_both_seeds():
    cases = grid(list(FAULTS), "full")
    healthy = [c for c in cases if c.fault is None]
    workloads = healthy_workloads(list(FAULTS))
    assert next(iter(workloads)) == "default"
    assert sorted((c.workload, c.split) for c in healthy) == sorted(
        (w, s) for w in workloads for s in ("dev", "holdout")
    )
    # every fault's setting is among them
    assert {f for names in workloads.values() for f in names} == set(FAULTS)
    assert all(c.expected is None for c in healthy)


def test_a_healthy_run_under_a_faults_workload_has_its_demand_and_engine_but_no_switch():
    base = ScenarioConfig(out=Path("/nonexistent"))
    batch = next(c for c in grid(list(FAULTS), "full") if c.fault is None and c.workload == "oversized_batch")
    cfg = ev.case_config(batch, base, Path("/nonexistent/run"))
    assert cfg.fault is None and cfg.value is None
    assert fault_clients(cfg) == FAULTS["oversized_batch"].clients
    quant = ev.case_config(Case(None, 100, workload="weight_quant_off"), base, Path("/x"))
    assert "--weight-dtype" in quant.engine_args()
    prefix = ev.case_config(Case(None, 100, workload="prefix_cache_miss"), base, Path("/x"))
    assert fault_workload(prefix)["system_prompt_tokens"] == 1024
    default = ev.case_config(Case(None, 100, onset_fraction=0.3, load_fraction=0.5), base, Path("/x"))
    assert fault_workload(default) == {} and default.load_fraction == 0.5
    assert default.onset == pytest.approx(0.3 * default.duration_s)


def test_a_healthy_run_under_a_fleet_faults_workload_is_the_same_fleet():
    base = ScenarioConfig(out=Path("/nonexistent"))
    workloads = healthy_workloads(list(FAULTS))
    fleet_default = next(w for w, names in workloads.items() if "replica_slow" in names)
    assert fleet_default != "default" and "replica_down" in workloads[fleet_default]
    for workload in (fleet_default, "routing_skew", "cache_affinity_lost"):
        cfg = ev.case_config(Case(None, 100, workload=workload), base, Path("/x"))
        assert cfg.fault is None and cfg.replicas == 3 and cfg.model == "tiny", workload
    skew = ev.case_config(Case(None, 100, workload="routing_skew"), base, Path("/x"))
    assert fault_clients(skew) == FAULTS["routing_skew"].clients
    assert ev.case_config(Case(None, 100), base, Path("/x")).replicas == 1


def test_quick_grid_is_one_case_per_fault_at_its_default_plus_two_healthy_workloads():
    quick = grid(list(FAULTS), "quick", ("dev",))
    faulty = [c for c in quick if c.fault]
    assert [c.fault for c in faulty] == list(FAULTS)
    assert all(c.value == FAULTS[c.fault].default and c.onset_fraction == 0.5 for c in faulty)
    assert [c.workload for c in quick if c.fault is None] == ["default", "oversized_batch"]
    assert {c.split for c in quick} == {"dev"}
    assert grid(list(FAULTS), "quick", ("holdout",)) == []


def test_only_takes_faults_or_the_causes_they_produce():
    assert resolve_only(["queueing_overload", "long_prompts"]) == ["long_prompts", "overload"]
    with pytest.raises(ValueError, match="nope"):
        resolve_only(["nope"])


# -- scoring --------------------------------------------------------------------------------------
ONSET = 1000.0


def _diagnosis(*causes: str, onset: float = ONSET, regressed: tuple[str, ...] = ("ttft_p99",)) -> dict:
    findings = [
        {"cause": c, "confidence": round(0.9 - 0.1 * i, 2), "onset": onset} for i, c in enumerate(causes)
    ]
    return {"findings": findings, "regressions": [{"metric": m} for m in regressed] if causes else []}


def _row(case: Case, *causes: str, onset_error: float = 0.0, baseline: tuple[str, ...] | None = None) -> dict:
    truth = {"onset": ONSET if case.fault else None, "duration_s": 80, "requests_stored": 120}
    head = _diagnosis(*causes, onset=ONSET + onset_error)
    given = _diagnosis(*(causes if baseline is None else baseline), onset=ONSET)
    return score(case, truth, {"no_baseline": head, "baseline": given})


def _synthetic_rows() -> list[dict[str, Any]]:
    dev, hold = 1, 1001
    return [
        # dev: 2 of 3 right at top-1
        _row(Case("overload", dev, 0), "queueing_overload", onset_error=2.0),
        _row(Case("long_prompts", dev, 0), "long_prompts", onset_error=4.0),
        _row(Case("scheduler_stall", dev, 0), "rpc_overhead", "scheduler_stall"),
        # holdout: 2 of 4 right at top-1, 3 of 4 in the top 3, one unexplained, one with no finding
        _row(Case("overload", hold, 0), "queueing_overload", onset_error=1.0),
        _row(Case("long_prompts", hold, 1), "long_prompts", onset_error=9.0, baseline=()),
        _row(Case("scheduler_stall", hold, 0), "queueing_overload", "rpc_overhead", "scheduler_stall"),
        _row(Case("rpc_overhead", hold, 1), "unexplained"),
        _row(Case("kv_cache_pressure", hold, 1)),
        # healthy: a finding under the oversized_batch workload (holdout), none elsewhere
        _row(Case(None, 100)),
        _row(Case(None, 1100)),
        _row(Case(None, 100, workload="oversized_batch")),
        _row(Case(None, 1100, workload="oversized_batch"), "oversized_batch"),
    ]


def test_the_summary_counts_a_known_set_of_rows_right():
    rows = _synthetic_rows()
    s = summarize(rows, "full")
    assert s["grid"] == "full" and s["cases"] == 12 and s["fault_cases"] == 8 and s["healthy_runs"] == 4
    assert s["top1_dev"] == round(2 / 3, 3)
    assert s["top1_holdout"] == 0.4  # overload, long_prompts right of 5
    assert s["top3_holdout"] == 0.6  # + scheduler_stall third
    assert s["top3_dev"] == 1.0
    assert s["unexplained_rate"] == 0.2
    assert s["healthy_false_positives"] == 1
    assert s["healthy_false_positives_by_workload"] == {
        "default": {"runs": 2, "false_positives": 0, "rate": 0.0},
        "oversized_batch": {"runs": 2, "false_positives": 1, "rate": 0.5},
    }
    # onset error over the holdout's right top findings: 1 and 9 s
    assert s["onset_error_p50_s"] == 5.0 and s["onset_error_p90_s"] == 8.2
    assert s["by_split"]["dev"]["onset_error_p90_s"] == 3.8
    c = s["confusion"]
    assert c["scheduler_stall"] == {"rpc_overhead": 1, "queueing_overload": 1}
    assert c["kv_cache_pressure"] == {"none": 1} and c["rpc_overhead"] == {"unexplained": 1}
    assert c["healthy"] == {"none": 3, "oversized_batch": 1}
    assert s["confusion_by_split"]["dev"]["queueing_overload"] == {"queueing_overload": 1}
    # with the baseline given, long_prompts holdout had no finding
    assert s["baseline_mode"]["holdout"]["top1"] == 0.2


def test_a_without_rule_summary_counts_unexplained_and_is_no_scoreboard():
    dev, hold = 1, 1001
    off = {"without_rule": "long_prompts"}
    rows = [
        _row(Case("long_prompts", dev, 0, **off), "unexplained"),
        _row(Case("long_prompts", hold, 0, **off), "unexplained"),
        _row(Case("long_prompts", hold, 1, **off), "queueing_overload"),
    ]
    s = summarize(rows, "full", without_rule="long_prompts")
    assert s["unexplained_dev"] == 1.0 and s["unexplained_holdout"] == 0.5
    assert s["named_instead"] == {rows[2]["case"]: "queueing_overload"}
    # the latest result with a top-1 is the scoreboard: a without-rule file must not read as one
    assert not {"top1_holdout", "top1_dev", "healthy_false_positives"} & set(s)
    page = markdown(s, rows)
    assert "its rule off" in page and "queueing_overload" in page


def test_a_row_carries_the_cases_draws_and_the_top_three_causes():
    case = draw("overload", 0, 1001, "overload")
    row = _row(case, "queueing_overload", "long_prompts", "scheduler_stall", "rpc_overhead", onset_error=3.0)
    assert row["split"] == "holdout" and row["magnitude"] == case.value and row["seed"] == 1001
    assert row["onset_fraction"] == case.onset_fraction and row["load_fraction"] == case.load_fraction
    assert row["expected"] == "queueing_overload" and row["correct"] and row["onset_error_s"] == 3.0
    assert [t["cause"] for t in row["top3"]] == ["queueing_overload", "long_prompts", "scheduler_stall"]
    assert row["top3"][0]["confidence"] == 0.9 and row["symptoms_regressed"] == ["ttft_p99"]


def test_percentiles_interpolate_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 10.0], 90) == 7.6


# -- the command: resume, merge, rediagnose ---------------------------------------------------------
@pytest.fixture
def fake_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stand in for real scenario runs: each writes a made-up stored run and its row, right for the
    dev cases and the default workload, a miss and a finding otherwise."""
    ran: list[str] = []

    def run_case(case: Case, runs_dir: Path, base: Any, capacities: Any) -> dict[str, Any]:
        ran.append(case.name)
        out = runs_dir / case.name
        out.mkdir(parents=True)
        (out / "case.json").write_text(json.dumps(case.to_json()))
        (out / "truth.json").write_text(json.dumps({"onset": ONSET, "start": 0, "end": 1}))
        right = case.split == "dev" or case.fault is None
        causes = (case.expected,) if case.fault and right else ("long_prompts",) if not right else ()
        return evaldir.write_row(case, out, _row(case, *causes) | {"run_s": 90.0})

    monkeypatch.setattr(ev, "run_case", run_case)
    return ran


def _eval(tmp_path: Path, *argv: str) -> int:
    return main(["eval", *argv, "--out", str(tmp_path / "eval"), "--results-dir", str(tmp_path / "results")])


def test_resume_skips_finished_cases_and_merges_the_rows_of_every_sitting(
    tmp_path: Path, fake_runs: list[str], capsys: pytest.CaptureFixture[str]
):
    assert _eval(tmp_path, "--only", "overload", "--split", "dev") == 0
    assert sorted(fake_runs) == ["healthy-default-s100", "overload-m0-s1", "overload-m1-s1"]
    capsys.readouterr()
    assert _eval(tmp_path, "--only", "overload") == 2  # the directory holds an eval: --resume or a new one
    assert "--resume" in capsys.readouterr().err
    fake_runs.clear()
    assert _eval(tmp_path, "--only", "overload", "--resume") == 0
    assert sorted(fake_runs) == ["healthy-default-s1100", "overload-m0-s1001", "overload-m1-s1001"]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["cases"] == 6 and summary["sittings"] == 2 and not summary["complete"]
    assert summary["top1_dev"] == 1.0 and summary["top1_holdout"] == 0.0
    assert summary["healthy_false_positives"] == 0
    lines = (tmp_path / "eval" / "cases.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["case"] for line in lines) == sorted(
        ["healthy-default-s100", "healthy-default-s1100", "overload-m0-s1", "overload-m1-s1",
         "overload-m0-s1001", "overload-m1-s1001"]
    )  # fmt: skip
    assert "top-1" in (tmp_path / "eval" / "summary.md").read_text()
    [result] = (tmp_path / "results").glob("*-eval-full-partial.json")
    document = json.loads(result.read_text())
    assert document["result"]["top1_holdout"] == 0.0 and document["machine"]["cores"]
    assert len(document["load_avg_before"]) == 3 and document["arguments"]["resume"] is True
    assert document["result"]["out"] == document["arguments"]["out"] == "eval"  # the directory, by name
    fake_runs.clear()
    assert _eval(tmp_path, "--only", "overload", "--resume") == 0
    assert fake_runs == []  # nothing left to run


def _other_sitting(tmp_path: Path) -> Path:
    """The result file of the holdout half of `--only overload`, run in a directory of its own."""
    other = tmp_path / "other"
    assert main(["eval", "--only", "overload", "--split", "holdout", "--out", str(other / "eval"),
                 "--results-dir", str(other / "results")]) == 0  # fmt: skip
    [source] = (other / "results").glob("*-eval-full-partial.json")
    return source


def test_merge_takes_another_sittings_result_rows_and_runs_only_the_rest(
    tmp_path: Path, fake_runs: list[str], capsys: pytest.CaptureFixture[str]
):
    source = _other_sitting(tmp_path)  # the holdout half on another clone, whose stores stay there
    fake_runs.clear()
    capsys.readouterr()
    assert _eval(tmp_path, "--only", "overload", "--split", "dev", "--merge", str(source)) == 0
    assert sorted(fake_runs) == ["healthy-default-s100", "overload-m0-s1", "overload-m1-s1"]
    assert f"merged 3 of 3 rows from {source.name}" in capsys.readouterr().err
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["cases"] == 6 and summary["sittings"] == 2
    assert summary["top1_dev"] == 1.0 and summary["top1_holdout"] == 0.0
    assert summary["merged_from"] == {source.name: 3}
    assert source.name in (tmp_path / "eval" / "summary.md").read_text()
    # a merged row has no store: --rediagnose re-scores only the runs that are here
    capsys.readouterr()
    assert main(["eval", "--rediagnose", str(tmp_path / "eval"), "--results-dir", str(tmp_path / "r2")]) == 0
    assert "re-diagnosed 3 stored runs" in capsys.readouterr().err


def test_merge_refuses_a_file_of_another_grid_or_other_draws_and_writes_nothing(
    tmp_path: Path, fake_runs: list[str], capsys: pytest.CaptureFixture[str]
):
    source = _other_sitting(tmp_path)
    document = json.loads(source.read_text())
    document["result"]["rows"][0]["onset_fraction"] += 0.01  # drawn by another protocol
    redrawn = tmp_path / "redrawn.json"
    redrawn.write_text(json.dumps(document))
    not_eval = tmp_path / "ingest.json"
    not_eval.write_text(json.dumps({"result": {"spans_per_s": 1}}))
    for path, message in ((redrawn, "not a case of this grid as drawn now"),
                          (not_eval, "not an eval result file"),
                          (tmp_path / "missing.json", "not an eval result file")):  # fmt: skip
        fake_runs.clear()
        capsys.readouterr()
        assert _eval(tmp_path, "--only", "overload", "--split", "dev", "--merge", str(path)) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
        assert fake_runs == [] and not (tmp_path / "eval").exists()
    capsys.readouterr()
    assert _eval(tmp_path, "--duration", "60", "--merge", str(source)) == 2
    assert "is another eval" in capsys.readouterr().err


def test_only_healthy_runs_the_healthy_runs_of_every_workload_and_no_fault(
    tmp_path: Path, fake_runs: list[str]
):
    assert _eval(tmp_path, "--only", "healthy", "--split", "dev") == 0
    workloads = healthy_workloads(list(FAULTS))
    assert sorted(fake_runs) == sorted(f"healthy-{w}-s100" for w in workloads) and len(workloads) > 2
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["healthy_false_positives"] == 0 and summary["cases"] == len(workloads)


def test_rediagnose_rescores_stored_runs_without_running_them(
    tmp_path: Path, fake_runs: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    assert _eval(tmp_path, "--only", "overload", "--split", "holdout") == 0
    before = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert before["top1_holdout"] == 0.0
    fake_runs.clear()
    # the rules changed: every stored run now gets the right answer (healthy ones: nothing)
    monkeypatch.setattr(
        ev,
        "_diagnose_in_child",
        lambda run_dir, without_rule=None: {
            mode: _diagnosis() if "healthy" in run_dir.name else _diagnosis("queueing_overload")
            for mode in ("no_baseline", "baseline")
        },
    )
    capsys.readouterr()
    assert (
        main(["eval", "--rediagnose", str(tmp_path / "eval"), "--results-dir", str(tmp_path / "results")])
        == 0
    )
    assert fake_runs == []
    assert "re-diagnosed 3 stored runs" in capsys.readouterr().err
    after = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert after["rediagnosed"] is True and after["top1_holdout"] == 1.0 and after["cases"] == 3
    assert "re-diagnosed" in (tmp_path / "eval" / "summary.md").read_text()
    assert list((tmp_path / "results").glob("*-eval-full-partial-rediagnosed.json"))


@pytest.mark.parametrize(
    "argv,message",
    [(["--grid", "quick", "--split", "holdout"], "dev cases only"), (["--only", "nope"], "unknown fault"),
     (["--only", "healthy", "overload"], "runs alone"),
     (["--without-rule", "nope"], "unknown cause"), (["--duration", "x"], "expected seconds"),
     (["--only", "overload", "--without-rule", "long_prompts"], "no fault of the chosen ones"),
     (["--only", "healthy", "--without-rule", "long_prompts"], "--only healthy has none"),
     (["--rediagnose", "x", "--merge", "y.json"], "re-scores the stored runs alone")],
)  # fmt: skip
def test_bad_eval_options_exit_2_with_one_line(tmp_path: Path, argv: list[str], message: str, capsys):
    assert _eval(tmp_path, *argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "eval").exists()  # refused before anything was written


def test_rediagnose_refuses_a_directory_without_an_eval(tmp_path: Path, capsys):
    assert main(["eval", "--rediagnose", str(tmp_path)]) == 2
    assert "no protocol.json" in capsys.readouterr().err


def test_result_files_are_dated_with_the_commit_machine_and_load(tmp_path: Path):
    arguments = {"grid": "quick", "out": Path("/srv/runs/eval-a"), "results_dir": "/home/me/results"}
    path = results.write("eval-quick", {"top1_dev": 1.0}, arguments, (1.0, 2.0, 3.0), tmp_path)
    assert path.parent == tmp_path and path.name.endswith("-eval-quick.json")
    date, commit = path.name[:10], path.name[11:].removesuffix("-eval-quick.json")
    assert date.count("-") == 2 and commit
    doc = json.loads(path.read_text())
    assert doc["machine"]["cpu_model"] and doc["machine"]["cores"] >= 1
    assert doc["load_avg_before"] == [1.0, 2.0, 3.0] and len(doc["load_avg_after"]) == 3
    # directories by name, not where this machine keeps them
    assert doc["arguments"] == {"grid": "quick", "out": "eval-a", "results_dir": "results"}
    assert doc["result"] == {"top1_dev": 1.0}


def test_a_result_file_names_the_commit_it_is_told_when_run_from_a_copy(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("STEPSCOPE_COMMIT", "61a7bd0")
    path = results.write("batching-cuda", {"ratio": 1.4}, {}, (0.0, 0.0, 0.0), tmp_path)
    assert path.name.endswith("-61a7bd0-batching-cuda.json")
    assert json.loads(path.read_text())["commit"] == "61a7bd0"
