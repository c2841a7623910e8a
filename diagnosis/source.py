"""Where the diagnosis reads from: a store opened by DSN, or a running collector's `POST /api/sql`.

chDB allows one process per data directory, so while a collector holds a directory the diagnosis goes
through its API. Both run read-only SQL with ClickHouse server-side parameters (`{name:Type}`): the API
forwards `params` to ClickHouse's own binding, so no value is ever spliced into SQL text on either path.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import httpx

from collector.store import QueryError, QueryResult, Store, StoreError, StoreUnavailable


class SourceError(Exception):
    """The source cannot answer: unreachable collector, locked or broken store, refused query."""


class Source(Protocol):
    """Runs read-only SQL and returns columns and rows."""

    description: str

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult: ...

    def close(self) -> None: ...


class StoreSource:
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
            raise SourceError(str(e)) from e

    def close(self) -> None:
        self._store.close()


class ApiSource:
    """A running collector's read-only SQL endpoint (its row cap applies: the diagnosis stays under it)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.description = url.rstrip("/")

    def check(self) -> None:
        """Raise SourceError unless the collector answers and its store is up."""
        try:
            r = self._http.get("/health")
        except httpx.HTTPError as e:
            raise SourceError(f"collector at {self.description} unreachable: {e}") from e
        if r.status_code != 200 or r.json().get("store") != "up":
            raise SourceError(f"collector at {self.description} is not ready: {r.text[:200]}")

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        try:
            r = self._http.post("/api/sql", json={"sql": sql, "params": params or {}})
        except httpx.HTTPError as e:
            raise SourceError(f"collector at {self.description} unreachable: {e}") from e
        if r.status_code != 200:
            try:
                message = r.json().get("error") or r.text
            except ValueError:
                message = r.text
            raise SourceError(f"collector answered {r.status_code}: {str(message)[:300]}")
        body = r.json()
        return QueryResult(body["columns"], body["rows"], bool(body.get("truncated")))

    def close(self) -> None:
        self._http.close()


def open_source(store: str | None = None, api: str | None = None, token: str | None = None) -> Source:
    """A Source over a store DSN (`chdb:///dir`, `http://user:pass@host:8123/db`) or a collector's URL.
    Exactly one of `store` and `api`. Raises ValueError for bad arguments, SourceError when unreachable."""
    if bool(store) == bool(api):
        raise ValueError("give exactly one of a store DSN or a collector API URL")
    if api:
        if not api.startswith(("http://", "https://")):
            raise ValueError(f"collector API URL {api!r} must start with http:// or https://")
        source = ApiSource(api, token)
        try:
            source.check()
        except SourceError:
            source.close()
            raise
        return source
    try:
        return StoreSource(Store.open(store or ""))
    except (StoreError, StoreUnavailable) as e:
        raise SourceError(str(e)) from e


def num(value: Any) -> float:
    """A query value as float; NULL, NaN (the API's null) and non-numbers read as NaN."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
