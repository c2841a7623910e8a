"""Fixtures: a real `stepscope collector` process on a free loopback port, and helpers to talk to it."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.collector import Collector
from tests.support.collector import start_collector as start


@pytest.fixture
def start_collector(tmp_path: Path) -> Iterator[Callable[..., Collector]]:
    """Start `stepscope collector` with the given extra arguments (default store: chdb in tmp_path)."""
    started: list[Collector] = []

    def start_one(
        *extra: str, store: str | None = None, token: str | None = None, port: int | None = None
    ) -> Collector:
        log = tmp_path / f"collector-{len(started)}.log"
        c = start(store or f"chdb://{tmp_path / 'data'}", log, *extra, token=token, port=port, timeout_s=60)
        started.append(c)
        return c

    yield start_one
    for c in started:
        c.stop(signal.SIGKILL)
