"""Every page, run by Streamlit's AppTest against a collector serving a real scenario's store; and the
empty-store, unreachable-API and empty-window cases, which must read as messages, never exceptions."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import diagnosis

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
PAGES = {
    "overview": "views/overview.py",
    "findings": "views/findings.py",
    "requests": "views/request_traces.py",
    "engine": "views/engine_steps.py",
    "instances": "views/instances.py",
    "capacity": "views/capacity.py",
    "gpu": "views/gpu.py",
}


def open_app(monkeypatch: pytest.MonkeyPatch, api: str, **env: str) -> AppTest:
    monkeypatch.setenv("STEPSCOPE_DASHBOARD_API", api)
    for key, value in env.items():
        monkeypatch.setenv(f"STEPSCOPE_DASHBOARD_{key.upper()}", value)
    at = AppTest.from_file(APP, default_timeout=180)
    return at.run()


def show(at: AppTest, page: str) -> AppTest:
    at.switch_page(PAGES[page]).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def charts(at: AppTest) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("vega_lite_chart")]


def texts(at: AppTest, kind: str) -> str:
    return " | ".join(str(el.value) for el in getattr(at, kind))


@pytest.mark.parametrize("page", list(PAGES))
def test_every_page_renders_the_scenario_with_a_chart_and_no_exception(
    monkeypatch: pytest.MonkeyPatch, api: str, page: str
) -> None:
    at = show(open_app(monkeypatch, api), page)
    assert at.title, "every page has a title"
    assert charts(at), f"{page}: no chart"
    assert not at.warning, texts(at, "warning")


def test_overview_shows_the_slo_tiles(monkeypatch: pytest.MonkeyPatch, api: str) -> None:
    at = show(open_app(monkeypatch, api, slo_ttft_s="2", slo_tpot_s="0.2"), "overview")
    labels = [m.label for m in at.metric]
    assert labels == ["P99 TTFT", "P99 TPOT", "Goodput", "Throughput", "Firing alerts"]
    assert at.metric[0].value.endswith(("ms", " s")) and "vs SLO 2.00 s" in at.metric[0].delta
    assert at.metric[2].value.endswith("req/s")
    assert at.metric[4].value == "none"  # no rule has fired: the collector ran without --alert-rules


def test_findings_render_the_diagnosis_of_the_scenario(monkeypatch: pytest.MonkeyPatch, api: str) -> None:
    at = show(open_app(monkeypatch, api), "findings")
    assert not [i for i in at.info if "Diagnosis unavailable" in str(i.value)], texts(at, "info")
    headers = [str(h.value) for h in at.subheader]
    findings = [h for h in headers if h[:1].isdigit()]
    causes = [h.split(". ", 1)[1].split(" (", 1)[0] for h in findings]
    said = (headers, texts(at, "info"), texts(at, "success"))
    assert causes and causes[0] == "prefix_cache_miss", said  # the scenario's injected fault
    assert set(causes) <= set(diagnosis.CAUSES), causes
    assert len(at.code) == len(findings), "each finding carries its SQL"
    assert "Regressions" in headers, headers


def test_requests_waterfall_shows_the_phases_and_the_engine_steps_it_shared(
    monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    at = show(open_app(monkeypatch, api), "requests")
    assert at.dataframe, "the searchable table"
    (waterfall,) = [
        spec for spec in charts(at) for y in [spec.get("encoding", {}).get("y", {})] if "sort" in y
    ]
    lanes = set(waterfall["encoding"]["y"]["sort"])  # the lanes, top to bottom
    assert {"request (server)", "queue", "prefill chunk 0", "decode", "engine steps"} <= lanes, lanes
    slowest = at.selectbox(key="req_trace").value
    at.text_input(key="req_search").set_value(slowest[:12]).run()
    assert not at.exception
    assert at.selectbox(key="req_trace").options == [at.selectbox(key="req_trace").options[0]]


def test_engine_page_charts_the_step_loop_and_the_batch_bend(
    monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    at = show(open_app(monkeypatch, api), "engine")
    titles = {spec.get("title") for spec in charts(at)}
    for want in ("Batch size and queue", "KV-cache usage", "Preemptions", "Step time vs batch size"):
        assert want in titles, titles


def test_gpu_page_labels_host_cpu_when_there_is_no_gpu(monkeypatch: pytest.MonkeyPatch, api: str) -> None:
    at = show(open_app(monkeypatch, api), "gpu")
    titles = " ".join(str(spec.get("title")) for spec in charts(at))
    assert "Step time" in titles
    assert "SM utilization" in titles or "Host CPU utilization (no GPU)" in titles


def test_capacity_reads_a_bench_results_file(
    monkeypatch: pytest.MonkeyPatch, api: str, bench_results: Path
) -> None:
    at = show(open_app(monkeypatch, api), "capacity")
    assert "No load-test results chosen" in texts(at, "info")
    at.text_input(key="cap_path").set_value(str(bench_results)).run()
    assert not at.exception
    tiles = {m.label: m.value for m in at.metric}
    assert tiles["Recommended load"] == "3.2" and tiles["Knee"] == "none"
    titles = {str(spec.get("title")) for spec in charts(at)}
    assert "Step load: throughput and goodput" in titles and "Throughput vs load (from traffic)" in titles


def test_capacity_finds_results_under_bench_dir_and_refuses_other_json(
    monkeypatch: pytest.MonkeyPatch, api: str, bench_results: Path, tmp_path: Path
) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "results.json").write_bytes(bench_results.read_bytes())
    (tmp_path / "runs" / "other.json").write_text('{"not": "a bench"}')
    at = show(open_app(monkeypatch, api, bench_dir=str(tmp_path / "runs")), "capacity")
    assert at.selectbox(key="cap_found").options == [str(tmp_path / "runs" / "results.json")]
    assert any(m.label == "Cost per 1k requests" for m in at.metric)
    at.text_input(key="cap_path").set_value(str(tmp_path / "runs" / "other.json")).run()
    assert not at.exception
    assert "not a `stepscope bench` results.json" in texts(at, "warning")


def test_a_range_with_no_data_says_so(monkeypatch: pytest.MonkeyPatch, api: str) -> None:
    at = open_app(monkeypatch, api)
    at.selectbox(key="range_choice").set_value("Custom").run()
    at.datetime_input(key="range_from").set_value(dt.datetime(2020, 1, 1, 0, 0)).run()
    at.datetime_input(key="range_to").set_value(dt.datetime(2020, 1, 1, 1, 0)).run()
    for page in ("overview", "requests", "engine", "findings"):
        show(at, page)
        assert "No " in texts(at, "info"), (page, texts(at, "info"))


@pytest.mark.parametrize("page", list(PAGES))
def test_an_empty_store_reads_as_a_message(
    monkeypatch: pytest.MonkeyPatch, empty_api: str, page: str
) -> None:
    at = show(open_app(monkeypatch, empty_api), page)
    assert "holds no requests yet" in texts(at, "info")
    assert not at.warning


@pytest.mark.parametrize("page", ["overview", "requests"])
def test_an_unreachable_api_reads_as_a_message(
    monkeypatch: pytest.MonkeyPatch, dead_api: str, page: str
) -> None:
    at = show(open_app(monkeypatch, dead_api), page)
    assert "Cannot reach the collector's API" in texts(at, "warning")
