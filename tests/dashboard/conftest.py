"""Fixtures: a store filled by a short real scenario (engine + collector + load generator, with a prefix-cache
fault at its midpoint), a collector serving it, an empty collector, and a URL where nothing answers.

The scenario runs once per session (about 30 s of traffic at a fixed rate, so no calibration run).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Collector:
    """A running `stepscope collector` and where it answers."""

    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_collector(store: str, log: Path, *extra: str) -> Collector:
    """Start a collector on a free port and wait until /health answers."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                "stepscope",
                "collector",
                "--store",
                store,
                "--port",
                str(port),
                "--log-level",
                "warning",
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    c = Collector(proc, f"http://127.0.0.1:{port}", log)
    for _ in range(480):
        try:
            if httpx.get(f"{c.url}/health", timeout=1).status_code == 200:
                return c
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    c.stop()
    raise AssertionError(f"collector did not start:\n{log.read_text()[-2000:]}")


def _store_dir(run: Path) -> Path:
    """The chDB directory a scenario left (the directory holding its `status` file)."""
    found = sorted(p.parent for p in run.rglob("status"))
    return found[0] if found else run


@pytest.fixture(scope="session")
def scenario_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real scenario: `stepscope scenario run --fault prefix_cache_miss` on the tiny model, 30 s of load."""
    run = tmp_path_factory.mktemp("scenario")
    cmd = ["stepscope", "scenario", "run", "--fault", "prefix_cache_miss", "--onset", "15",
           "--duration", "30", "--rate", "6", "--model", "tiny", "--out", str(run)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"scenario failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return run


@pytest.fixture(scope="session")
def api(scenario_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A collector serving the scenario's store; its URL."""
    log = tmp_path_factory.mktemp("collector") / "collector.log"
    c = start_collector(f"chdb://{_store_dir(scenario_run)}", log)
    yield c.url
    c.stop()


@pytest.fixture(scope="session")
def empty_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A collector over a fresh, empty store; its URL."""
    root = tmp_path_factory.mktemp("empty")
    c = start_collector(f"chdb://{root / 'data'}", root / "collector.log")
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
