"""Request spans only (as vLLM and SGLang emit) plus the engine's scraped /metrics samples: the causes that
need batch, KV and preemption evidence read it from the samples; what only step spans carry is named as
missing. Generated scenarios (diag_scenarios) in a real chDB store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from diag_scenarios import DURATION_S, SCENARIOS, placed
from diag_simulate import write

from collector.client import StoreReader
from collector.store import Store
from diagnosis import TimeRange, diagnose

NAMES = (
    "vllm_kv_cache_pressure",
    "vllm_oversized_batch",
    "vllm_overload",
    "vllm_long_outputs",
    "vllm_batch_limit_low",
    "vllm_batch_limit_low_unpublished",
)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreReader]:
    store = Store.open(f"chdb://{tmp_path_factory.mktemp('engine-samples')}")
    for name in NAMES:
        write(store, placed(name))
    reader = StoreReader(store)
    yield reader
    reader.close()


def whole(name: str) -> TimeRange:
    cfg = placed(name)
    return TimeRange(cfg.t0, cfg.t0 + DURATION_S)


def halves(name: str) -> tuple[TimeRange, TimeRange]:
    cfg = placed(name)
    mid = cfg.t0 + DURATION_S / 2
    return TimeRange(cfg.t0, mid), TimeRange(mid, cfg.t0 + DURATION_S)


@pytest.mark.parametrize("name", ["vllm_kv_cache_pressure", "vllm_oversized_batch", "vllm_batch_limit_low"])
def test_the_cause_is_named_from_scraped_samples(source: StoreReader, name: str) -> None:
    result = diagnose(source, window=whole(name)).to_json()
    assert result["data"]["steps"]["current"] in (None, 0)
    assert result["data"]["engine_evidence"] == "metrics"
    top = result["findings"][0]
    assert top["cause"] == SCENARIOS[name][1]
    assert "from scraped engine metrics" in top["summary"]
    assert "FROM engine_intervals" in top["sql"]
    lacking = {n["cause"]: n["missing"] for n in result["not_enough_data"]}
    assert "gaps between steps" in lacking["scheduler_stall"]
    assert "scraped engine metrics do not carry it" in lacking["scheduler_stall"]
    assert {"kv_cache_pressure", "oversized_batch", "batch_limit_low"}.isdisjoint(lacking)


def test_kv_pressure_evidence_quotes_the_scraped_series(source: StoreReader) -> None:
    result = diagnose(source, window=whole("vllm_kv_cache_pressure")).to_json()
    evidence = {e["metric"]: e for e in result["findings"][0]["evidence"]}
    rate = evidence["preemptions_per_1k_steps_est"]
    assert rate["current"] > rate["baseline"] + 2
    assert evidence["kv_usage_p90"]["current"] >= 0.9
    blocks = evidence["kv_blocks_total"]  # the pool cut from 4096 to 64 blocks at the onset
    assert blocks["baseline"] > 10 * blocks["current"] and blocks["current"] < 200


def test_overload_on_request_spans_and_samples_stays_queueing(source: StoreReader) -> None:
    result = diagnose(source, window=whole("vllm_overload")).to_json()
    assert result["findings"][0]["cause"] == "queueing_overload"


def test_long_outputs_reads_the_running_batch_from_the_samples(source: StoreReader) -> None:
    result = diagnose(source, window=whole("vllm_long_outputs")).to_json()
    assert result["data"]["engine_evidence"] == "metrics"
    top = result["findings"][0]
    assert top["cause"] == "long_outputs"
    assert "scraped engine metrics" in top["summary"]
    evidence = {e["metric"]: e for e in top["evidence"]}
    assert evidence["output_tokens_mean"]["current"] > 2 * evidence["output_tokens_mean"]["baseline"]
    assert evidence["batch_size_mean"]["current"] > 2 * evidence["batch_size_mean"]["baseline"]
    assert evidence["kv_usage_mean"]["current"] > evidence["kv_usage_mean"]["baseline"]
    assert evidence["max_num_seqs"]["current"] == evidence["max_num_seqs"]["baseline"] == 16


def test_batch_limit_low_quotes_the_published_limit(source: StoreReader) -> None:
    before, after = halves("vllm_batch_limit_low")
    result = diagnose(source, window=after, baseline=before).to_json()
    top = result["findings"][0]
    assert top["cause"] == "batch_limit_low"
    evidence = {e["metric"]: e for e in top["evidence"]}
    limit = evidence["max_num_seqs"]  # the scrapes' mean: the first one may still read the old limit
    assert limit["baseline"] == 16 and 2 <= limit["current"] < 2.5
    assert evidence["batch_size_mean"]["current"] <= 2
    assert evidence["waiting_requests_mean"]["current"] > 10 * evidence["waiting_requests_mean"]["baseline"]
    assert "step_s_mean" not in evidence, "no step times without step spans"
    assert source.query(top["sql"]).rows, "the evidence query runs on engine_intervals as printed"


def test_batch_limit_low_without_a_published_limit_says_so(source: StoreReader) -> None:
    """vLLM's /metrics has no max_num_seqs: the lowered cap cannot be told from the samples."""
    result = diagnose(source, window=whole("vllm_batch_limit_low_unpublished")).to_json()
    assert "batch_limit_low" not in {f["cause"] for f in result["findings"]}
    assert result["findings"][0]["cause"] == "unexplained"
    lacking = {n["cause"]: n["missing"] for n in result["not_enough_data"]}
    assert "publish no max_num_seqs" in lacking["batch_limit_low"]
