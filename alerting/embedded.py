"""Alerting inside the collector process (`stepscope collector --alert-rules rules.toml`).

chDB lets one process open a data directory, so the collector evaluates the rules itself. Queries go
through the store's read path (`Store.query_readonly`: its own ClickHouse session under readonly=1, with
the same limits as `/api/sql`, so the two never re-arm each other's session); transitions are appended to
the `alerts` table. Ingest is untouched: evaluation runs on its own threads and only reads.
"""

from __future__ import annotations

import logging
from typing import Any

from alerting.rules import RuleSet
from alerting.runner import LATEST_STATES_SQL, AlertRunner, StoreHistory
from collector.store import QueryResult, StoreUnavailable

log = logging.getLogger("alerting")


class CollectorStoreSource:
    """Read-only queries on the collector's store, once the ingestor has opened it."""

    def __init__(self, ingestor: Any, max_rows: int, timeout_s: float) -> None:
        self._ingestor = ingestor
        self._limits = {"max_rows": max_rows, "timeout_s": timeout_s}

    def query(self, sql: str, parameters: dict[str, Any] | None = None, /) -> QueryResult:
        store = self._ingestor.store
        if store is None:
            raise StoreUnavailable(f"the store is not available: {self._ingestor.store_error or 'starting'}")
        return store.query_readonly(sql, parameters=parameters, **self._limits)


def start_in_collector(ruleset: RuleSet, ingestor: Any, config: Any) -> AlertRunner:
    """Start evaluating `ruleset` on the collector's store; call after `ingestor.start()`."""
    source = CollectorStoreSource(ingestor, config.query_max_rows, config.query_timeout_s)
    runner = AlertRunner(
        ruleset,
        source,
        history=StoreHistory(lambda: ingestor.store),
        description=f"collector on {config.host}:{config.port}",
        external_url=f"http://{config.host}:{config.port}",
    )
    try:
        runner.restore(source.query(LATEST_STATES_SQL).rows)
    except Exception as e:  # no history yet, or the store is down: start from inactive
        log.info("alerting: no earlier alert states (%s)", e)
    return runner.start()
