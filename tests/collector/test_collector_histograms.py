"""Percentiles from scraped histograms: Prometheus's histogram_quantile on bucket increases in the store."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from collector.histograms import histogram_quantile, percentiles
from collector.scrape import _samples, to_arrow
from collector.store import Store

PAGE = (Path(__file__).resolve().parents[1] / "data" / "scrape" / "vllm_v1.txt").read_text()
INF = math.inf


def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    buckets = [(0.1, 10), (0.5, 60), (1.0, 90), (INF, 100)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 40 / 50)
    assert histogram_quantile(0.9, buckets) == pytest.approx(1.0)
    assert histogram_quantile(0.99, buckets) == 1.0  # in +Inf: the largest finite bound
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0), (INF, 0)]))
    assert math.isnan(histogram_quantile(0.5, [(0.1, 3)]))  # no +Inf bucket: not a histogram


def scrape_rows(text: str, t_ns: int) -> list[list]:
    metric, value, labels, source = map(list, zip(*_samples(text, {}), strict=True))
    n = len(metric)
    return [[t_ns] * n, ["vllm"] * n, ["vllm-0"] * n, metric, value, labels, source, ["scrape"] * n]


def test_percentiles_come_from_the_increase_of_the_buckets_over_the_window(tmp_path: Path) -> None:
    """Two scrapes: what the histogram held before the window does not count, what it gained does."""
    before = PAGE
    # 100 more first tokens, all between 0.25 s and 0.5 s: only they are in the window.
    after = PAGE
    for le, n in (("0.5", 100), ("0.75", 100), ("1.0", 100), ("2.5", 100), ("5.0", 100), ("7.5", 100),
                  ("10.0", 100), ("20.0", 100), ("40.0", 100), ("80.0", 100), ("160.0", 100),
                  ("640.0", 100), ("2560.0", 100), ("+Inf", 100)):  # fmt: skip
        line = next(
            x
            for x in PAGE.splitlines()
            if x.startswith(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}"')
        )
        value = float(line.rsplit(" ", 1)[1])
        after = after.replace(line, f"{line.rsplit(' ', 1)[0]} {value + n}")
    now = time.time()
    with Store.open(f"chdb://{tmp_path / 'store'}") as store:
        for t, text in ((now - 10, before), (now - 5, after)):
            table = to_arrow(scrape_rows(text, int(t * 1e9)))
            store.insert("engine_samples", table.column_names, table)
        got = percentiles(store, "ttft_s", now - 8, now)
        everything = percentiles(store, "ttft_s", now - 60, now)
    assert got["count"] == 100
    assert 0.25 < got["p50"] < 0.5 and 0.25 < got["p99"] <= 0.5
    assert everything["count"] == 100  # the first scrape in the lookback only anchors the second
