"""Fixtures: a store filled by a short real scenario (engine + collector + load generator, with a prefix-cache
fault at its midpoint), a collector serving it, an empty collector, and a URL where nothing answers.

The scenario runs once per session (60 s of traffic at a fixed rate, so no calibration run).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.collector import start_collector
from tests.support.net import free_port


def _store_dir(run: Path) -> Path:
    """The chDB directory a scenario left (the directory holding its `status` file)."""
    found = sorted(p.parent for p in run.rglob("status"))
    return found[0] if found else run


@pytest.fixture(scope="session")
def scenario_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real scenario: `stepscope scenario run --fault prefix_cache_miss=1.0` on the tiny model, 90 s of
    load with the fault at 45 s. Every request misses from the onset, and each side holds nine 5 s blocks
    for the diagnosis's autocorrelation-aware test. With 30 s a side its TTFT P50 p-value ranged over
    1e-12..2e-8 in three runs here, and one run of the whole suite found no regression."""
    run = tmp_path_factory.mktemp("scenario")
    cmd = ["stepscope", "scenario", "run", "--fault", "prefix_cache_miss=1.0", "--onset", "45",
           "--duration", "90", "--rate", "6", "--model", "tiny", "--out", str(run)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"scenario failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return run


@pytest.fixture(scope="session")
def api(scenario_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A collector serving the scenario's store; its URL."""
    log = tmp_path_factory.mktemp("collector") / "collector.log"
    c = start_collector(f"chdb://{_store_dir(scenario_run)}", log, "--log-level", "warning")
    yield c.url
    c.stop()


@pytest.fixture(scope="session")
def empty_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A collector over a fresh, empty store; its URL."""
    root = tmp_path_factory.mktemp("empty")
    c = start_collector(f"chdb://{root / 'data'}", root / "collector.log", "--log-level", "warning")
    yield c.url
    c.stop()


@pytest.fixture(scope="session")
def bench_results() -> Path:
    """A results.json recorded from a real `stepscope bench` run (tiny model, chat, concurrency 1,2,4)."""
    return Path(__file__).parent / "data" / "bench_results.json"


@pytest.fixture
def dead_api() -> str:
    """A URL where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"
