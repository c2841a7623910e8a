"""The dashboard's pure parts: time ranges, bench files, the waterfall, the config, the CLI's refusals."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pandas as pd
import pytest

from collector.timerange import DataSpan, TimeRange
from dashboard import bench, timerange, waterfall
from dashboard.config import DashboardConfig

NOW = 1_800_000_000.0


def test_auto_range_is_the_last_15_minutes_when_they_hold_requests() -> None:
    r = timerange.resolve(timerange.AUTO, NOW, DataSpan(10, NOW - 100, NOW - 5))
    assert (r.start, r.end, r.note) == (NOW - 900, NOW, None)
    assert r.interval_s == 5  # about 30 buckets over the ~95 s of data, not over 15 minutes


def test_auto_range_falls_back_to_the_stored_span_and_says_so() -> None:
    r = timerange.resolve(timerange.AUTO, NOW, DataSpan(10, NOW - 7200.5, NOW - 7100.2))
    assert (r.start, r.end) == (NOW - 7201, NOW - 7100)
    assert r.note and "stored data" in r.note


def test_presets_custom_and_all() -> None:
    span = DataSpan(3, NOW - 50_000, NOW - 10)
    assert timerange.resolve("Last 1 h", NOW, span).start == NOW - 3600
    assert timerange.resolve(timerange.ALL, NOW, span).start == NOW - 50_000
    assert timerange.resolve(timerange.CUSTOM, NOW, span, (NOW - 60, NOW - 30)).seconds == 30
    # a custom range that is not a range falls back to auto rather than failing
    assert timerange.resolve(timerange.CUSTOM, NOW, span, (NOW, NOW - 30)).label == "last 15 min"


def test_baseline_is_the_span_just_before() -> None:
    r = TimeRange(100.0, 160.0, "x")
    assert (r.before().start, r.before().end) == (40.0, 100.0)
    first, second = r.halves()
    assert (first.end, second.start) == (130.0, 130.0)
    with pytest.raises(ValueError):
        TimeRange(5.0, 5.0, "empty")


def test_bench_results_are_read_and_flattened(tmp_path: Path, bench_results: Path) -> None:
    res = bench.load(bench_results)
    df = bench.steps_frame(res)
    assert list(df["load"]) == [1.0, 2.0, 4.0]
    assert df["p99_ttft_ms"].iloc[0] == pytest.approx(res.body["steps"][0]["ttft_s"]["p99"] * 1000)
    assert res.load_unit.startswith("concurrency")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "r.json").write_bytes(bench_results.read_bytes())
    (tmp_path / "a" / "x.json").write_text("[1, 2]")
    assert bench.find(tmp_path) == [tmp_path / "a" / "r.json"]


@pytest.mark.parametrize(
    "body, message",
    [("{", "is not JSON"), ('{"steps": []}', "is not a `stepscope bench`"),
     ('{"steps": [], "knee": {}, "load_kind": "rate"}', "has no steps")],
)  # fmt: skip
def test_a_file_that_is_not_a_bench_result_is_refused(body: str, message: str) -> None:
    with pytest.raises(bench.BenchFileError, match=message):
        bench.parse(body, "f.json")


def test_waterfall_puts_phases_in_order_and_steps_last() -> None:
    t0 = pd.Timestamp("2026-01-01T00:00:00.000000Z")
    ms = pd.Timedelta(milliseconds=1)
    spans = pd.DataFrame(
        {
            "Timestamp": [t0, t0, t0 + 2 * ms, t0 + 5 * ms, t0 + 1 * ms, t0 + 9 * ms],
            "Duration": [20_000_000, 19_000_000, 3_000_000, 4_000_000, 1_000_000, 10_000_000],
            "SpanName": ["llm_client_request", "llm_request", "prefill", "prefill", "queue", "decode"],
            "SpanAttributes": [{}, {}, {"stepscope.prefill.chunk_index": "0"},
                               {"stepscope.prefill.chunk_index": "1"}, {}, {}],
        }
    )  # fmt: skip
    steps = pd.DataFrame(
        {"time": [t0 + 2 * ms], "duration_s": [0.003], "step_id": [7], "batch_size": [2],
         "prefill_tokens": [16], "decode_tokens": [1], "tokens_for_request": [16], "is_prefill": [True]}
    )  # fmt: skip
    rows = waterfall.build(spans, steps)
    assert list(rows["lane"]) == ["client request", "request (server)", "queue", "prefill chunk 0",
                                  "prefill chunk 1", "decode", "engine steps"]  # fmt: skip
    step = rows.iloc[-1]
    assert (step["start_ms"], step["end_ms"], step["kind"]) == (
        pytest.approx(2.0),
        pytest.approx(5.0),
        "step (prefill)",
    )


def test_config_travels_through_the_environment() -> None:
    cfg = DashboardConfig(api="http://h:1/", token="t", slo_tpot_s=0.05, bench_dir="/runs")
    back = DashboardConfig.from_env(cfg.to_env())
    assert back == DashboardConfig(api="http://h:1", token="t", slo_tpot_s=0.05, bench_dir="/runs")
    with pytest.raises(ValueError, match="http"):
        DashboardConfig(api="h:1")


@pytest.mark.parametrize("args", [["--api", "ftp://x"], ["--slo-ttft", "fast"], ["--port", "0"]])
def test_the_cli_refuses_bad_flags_with_exit_code_2(args: list[str]) -> None:
    done = subprocess.run(["stepscope", "dashboard", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("stepscope dashboard:") and "Traceback" not in done.stderr
