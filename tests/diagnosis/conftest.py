"""Fixtures: one real chDB store holding every generated scenario, each in its own stretch of time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from diag_scenarios import SCENARIOS, placed
from diag_simulate import write

from collector.client import StoreReader
from collector.store import Store


@pytest.fixture(scope="module")
def scenario_source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreReader]:
    """Every scenario written as otel_traces rows (the views fill requests and steps), read-only source.
    Module scope: chDB opens one directory per process at a time, so it is closed before others open."""
    store = Store.open(f"chdb://{tmp_path_factory.mktemp('scenarios')}")
    for name in SCENARIOS:
        write(store, placed(name))
    source = StoreReader(store)
    yield source
    source.close()
