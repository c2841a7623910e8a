"""`stepscope diagnose` and `stepscope query` end to end: a store written by the collector's views, the CLI
as a subprocess on it (`--store`) and through a running `stepscope collector` (`--api`)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from diag_scenarios import DURATION_S, placed
from diag_simulate import write

from collector.store import Store
from diagnosis.library import LIBRARY
from tests.support.collector import start_collector


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed chDB directory holding a prefix-cache-miss run (so subprocesses can open it)."""
    path = tmp_path_factory.mktemp("cli") / "data"
    with Store.open(f"chdb://{path}") as store:
        write(store, placed("prefix_cache_miss"))
    return path


def stepscope(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["stepscope", *args], capture_output=True, text=True, timeout=timeout)


def window_args() -> list[str]:
    t0 = placed("prefix_cache_miss").t0
    return ["--from", str(t0), "--to", str(t0 + DURATION_S)]


def test_diagnose_store_json_text_and_md(store_dir: Path) -> None:
    dsn = f"chdb://{store_dir}"
    out = stepscope("diagnose", "--store", dsn, *window_args(), "--format", "json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) >= {"window", "baseline", "regressions", "findings"}
    assert result["findings"][0]["cause"] == "prefix_cache_miss"
    assert {"metric", "baseline", "current", "ratio", "p_value"} <= set(result["regressions"][0])
    assert {"cause", "symptoms", "confidence", "onset", "evidence", "lever", "sql"} <= set(
        result["findings"][0]
    )
    text = stepscope("diagnose", "--store", dsn, *window_args())
    assert text.returncode == 0 and "1. prefix_cache_miss" in text.stdout and "lever:" in text.stdout
    md = stepscope("diagnose", "--store", dsn, *window_args(), "--format", "md")
    assert md.returncode == 0 and "### 1. `prefix_cache_miss`" in md.stdout and "```sql" in md.stdout


def test_diagnose_bad_input_exits_2_with_one_line(store_dir: Path, tmp_path: Path) -> None:
    cases = [
        ["--store", f"chdb://{store_dir}", "--from", "yesterday"],
        ["--store", f"chdb://{store_dir}", "--api", "http://127.0.0.1:9"],
        [],
        ["--api", "http://127.0.0.1:9"],
        ["--store", f"chdb://{tmp_path / 'nothing-here'}"],
        ["--store", f"chdb://{store_dir}", "--baseline-from", "1h"],
    ]
    for args in cases:
        out = stepscope("diagnose", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("stepscope diagnose:")


def test_query_list_and_every_named_query(store_dir: Path) -> None:
    listing = stepscope("query", "--list")
    assert listing.returncode == 0
    assert all(name in listing.stdout for name in LIBRARY)
    dsn = ["--store", f"chdb://{store_dir}"]
    t0 = placed("prefix_cache_miss").t0
    mid, end = t0 + DURATION_S / 2, t0 + DURATION_S
    slowest = stepscope(
        "query", "slowest", f"from={t0}", f"to={end}", "metric=ttft_s", "limit=5", *dsn, "--format", "json"
    )
    assert slowest.returncode == 0, slowest.stderr
    rows = json.loads(slowest.stdout)["rows"]
    assert len(rows) == 5 and rows[0][5] >= rows[-1][5]
    trace_id = rows[0][1]
    compare = stepscope(
        "query", "compare", f"a_from={t0}", f"a_to={mid}", f"b_from={mid}", f"b_to={end}", *dsn
    )
    assert compare.returncode == 0 and compare.stdout.splitlines()[0].startswith("window")
    assert len(compare.stdout.splitlines()) == 3
    waterfall = stepscope("query", "waterfall", f"trace_id={trace_id}", *dsn)
    assert waterfall.returncode == 0 and "llm_request" in waterfall.stdout and "#" in waterfall.stdout
    hits = stepscope("query", "cache_hit_rate", f"from={t0}", f"to={end}", "interval_s=20", *dsn)
    assert hits.returncode == 0 and len(hits.stdout.splitlines()) == 1 + 8
    steps = stepscope("query", "step_time_by_batch", *dsn)
    assert steps.returncode == 0 and "step_ms_p50" in steps.stdout


def test_query_bad_input_exits_2(store_dir: Path) -> None:
    dsn = ["--store", f"chdb://{store_dir}"]
    for args in (
        ["nope", *dsn],
        ["compare", "a_from=1", *dsn],
        ["slowest", "metric=status", *dsn],
        ["slowest", "limit=-3", *dsn],
        ["waterfall", "trace_id=x' OR 1", *dsn],
        ["slowest", "junk", *dsn],
    ):
        out = stepscope("query", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.startswith("stepscope query:")


@pytest.fixture
def collector(store_dir: Path, tmp_path: Path) -> Iterator[str]:
    """`stepscope collector` holding the store directory (so only its API can read it)."""
    store = f"chdb://{store_dir}"
    c = start_collector(store, tmp_path / "collector.log", "--spool", str(tmp_path / "spool"), store_up=True)
    try:
        yield c.url
    finally:
        c.stop()


def test_diagnose_and_query_through_a_running_collector(collector: str, store_dir: Path) -> None:
    out = stepscope("diagnose", "--api", collector, *window_args(), "--format", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["findings"][0]["cause"] == "prefix_cache_miss"
    direct = stepscope("diagnose", "--store", f"chdb://{store_dir}", *window_args())
    assert direct.returncode == 2, "the collector holds the chDB directory: only its API can read it"
    listed = stepscope("query", "step_time_by_batch", "--api", collector)
    assert listed.returncode == 0 and "step_ms_p50" in listed.stdout
