"""Read stepscope's tables from another program: through a running collector's API, or the store itself.

    from collector.client import open_reader
    reader = open_reader(url="http://127.0.0.1:4318", token=None)   # while a collector runs
    reader = open_reader(store="chdb://./stepscope-data")            # when none does (chDB: one process)
    result = reader.query("SELECT max(ttft_s) FROM requests WHERE service = {s:String}", {"s": "x"})
    result.columns, result.rows

Both readers answer SELECTs only (the API runs them under readonly=1; the direct reader too).
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx

from collector.store import QueryError, QueryResult, Store, StoreUnavailable


class Reader(Protocol):
    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult: ...

    def close(self) -> None: ...


class ApiReader:
    """Queries a running collector's `POST /api/sql`."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        try:
            r = self._http.post("/api/sql", json={"sql": sql, "params": parameters})
        except httpx.HTTPError as e:
            raise StoreUnavailable(f"collector at {self._http.base_url} unreachable: {e}") from e
        if r.status_code == 400:
            raise QueryError(r.json().get("error", r.text))
        if r.status_code != 200:
            raise StoreUnavailable(f"collector answered {r.status_code}: {r.text[:300]}")
        body = r.json()
        return QueryResult(body["columns"], body["rows"], bool(body.get("truncated")))

    def close(self) -> None:
        self._http.close()


class StoreReader:
    """Queries the store directly, read-only (for when no collector holds a chDB directory)."""

    def __init__(self, dsn: str, max_rows: int = 1_000_000, timeout_s: float = 300.0) -> None:
        self._store = Store.open(dsn, migrate=False)
        self._limits = {"max_rows": max_rows, "timeout_s": timeout_s}

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        return self._store.query_readonly(sql, parameters=parameters, **self._limits)

    def close(self) -> None:
        self._store.close()


def open_reader(*, url: str | None = None, store: str | None = None, token: str | None = None) -> Reader:
    """A reader over the collector's API (`url`) or, without one, over the store (`store` DSN)."""
    if url:
        return ApiReader(url, token)
    if store:
        return StoreReader(store)
    raise ValueError("give the collector's url or a store DSN")
