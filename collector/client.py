"""Read stepscope's tables from another program: through a running collector's API, or the store itself.

    from collector.client import open_reader
    reader = open_reader(url="http://127.0.0.1:4318", token=None)   # while a collector runs
    reader = open_reader(store="chdb://./stepscope-data")            # when none does (chDB: one process)
    result = reader.query("SELECT max(ttft_s) FROM requests WHERE service = {s:String}", {"s": "x"})
    result.columns, result.rows
    reader.close()

The one read path of the diagnosis, the alert evaluator's `--api` mode, the demo and the scenario tools.
chDB allows one process per data directory, so while a collector holds a directory readers go through its
`POST /api/sql`. Both readers answer SELECTs only (the API runs them under readonly=1; the direct reader
too), with ClickHouse server-side parameters (`{name:Type}`): the API forwards `params` to ClickHouse's
own binding, so no value is ever spliced into SQL text on either path. Every failure is a `ReadError`.
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx

from collector.store import QueryError, QueryResult, Store, StoreError, StoreUnavailable


class ReadError(Exception):
    """The reader cannot answer: unreachable collector, locked or broken store, refused query."""


class Reader(Protocol):
    """Runs read-only SQL and returns columns and rows."""

    description: str

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult: ...

    def close(self) -> None: ...


class ApiReader:
    """A running collector's read-only `POST /api/sql` (its row cap applies)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.description = url.rstrip("/")

    def check(self) -> None:
        """Raise ReadError unless the collector answers and its store is up."""
        try:
            r = self._http.get("/health")
        except httpx.HTTPError as e:
            raise ReadError(f"collector at {self.description} unreachable: {e}") from e
        if r.status_code != 200 or r.json().get("store") != "up":
            raise ReadError(f"collector at {self.description} is not ready: {r.text[:200]}")

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        try:
            r = self._http.post("/api/sql", json={"sql": sql, "params": params or {}})
        except httpx.HTTPError as e:
            raise ReadError(f"collector at {self.description} unreachable: {e}") from e
        if r.status_code != 200:
            try:
                message = r.json().get("error") or r.text
            except ValueError:
                message = r.text
            raise ReadError(f"collector answered {r.status_code}: {str(message)[:300]}")
        body = r.json()
        return QueryResult(body["columns"], body["rows"], bool(body.get("truncated")))

    def close(self) -> None:
        self._http.close()


class StoreReader:
    """A store opened by DSN, queried under ClickHouse's readonly=1 (migrations are applied at open, as the
    collector does, so columns added since the store was written exist)."""

    def __init__(self, store: Store, *, max_rows: int = 200_000, timeout_s: float = 300.0) -> None:
        self._store = store
        self._limits = {"max_rows": max_rows, "timeout_s": timeout_s}
        self.description = store.target.description

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        try:
            return self._store.query_readonly(sql, parameters=params, **self._limits)
        except (QueryError, StoreError) as e:
            raise ReadError(str(e)) from e

    def close(self) -> None:
        self._store.close()


def open_reader(*, url: str | None = None, store: str | None = None, token: str | None = None) -> Reader:
    """A reader over a collector's API (`url`, checked healthy) or a store DSN (`chdb:///dir`,
    `http://user:pass@host:8123/db`). Exactly one of `url` and `store`. Raises ValueError for bad
    arguments, ReadError when unreachable."""
    if bool(store) == bool(url):
        raise ValueError("give exactly one of a store DSN or a collector API URL")
    if url:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"collector API URL {url!r} must start with http:// or https://")
        reader = ApiReader(url, token)
        try:
            reader.check()
        except ReadError:
            reader.close()
            raise
        return reader
    try:
        return StoreReader(Store.open(store or ""))
    except (StoreError, StoreUnavailable) as e:
        raise ReadError(str(e)) from e
