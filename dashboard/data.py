"""The dashboard's only data source: the collector's query API over HTTP, answers as pandas frames.

Every failure becomes a `DataError` whose message a person can act on (the pages show it with
`st.warning`/`st.info`); nothing else escapes. Answers are cached for a few seconds (`st.cache_data`),
errors never are, so a collector that comes back is seen at the next refresh.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx
import pandas as pd
import streamlit as st

CACHE_TTL_S = 10  # a refresh every few seconds must not re-run every query
_ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}")


class DataError(Exception):
    """Anything that kept an answer from the API, with a message for the page."""


class Unreachable(DataError):
    """No answer at all: connection refused, DNS, timeout."""


class Refused(DataError):
    """The API answered with an error status (401, 5xx, ...)."""


class QueryFailed(DataError):
    """ClickHouse refused the SQL (400): for example a table that does not exist."""


class NotFound(DataError):
    """404: for example an unknown trace id."""


@dataclass(frozen=True, slots=True)
class Api:
    """Where the collector's API is (hashable: it is part of every cache key)."""

    url: str
    token: str | None = None
    timeout_s: float = 30.0

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One request; the decoded JSON body, or a DataError."""
        try:
            r = httpx.request(
                method, self.url + path, headers=self._headers(), timeout=self.timeout_s, **kwargs
            )
        except httpx.HTTPError as e:
            raise Unreachable(
                f"Cannot reach the collector's API at {self.url} ({type(e).__name__}). "
                "Is `stepscope collector` running there?"
            ) from None
        if r.status_code == 200:
            try:
                return r.json()
            except ValueError:
                raise Refused(
                    f"{self.url}{path} did not answer JSON: is this a stepscope collector?"
                ) from None
        raise _error(r, self.url + path)


def _error(r: httpx.Response, where: str) -> DataError:
    try:
        message = str(r.json().get("error", r.text))
    except ValueError:
        message = r.text
    message = message.strip()[:400]
    if r.status_code == 400:
        return QueryFailed(message)
    if r.status_code == 404:
        return NotFound(message or f"{where}: not found")
    if r.status_code == 401:
        return Refused("The collector wants a token: start the dashboard with --token (401).")
    if r.status_code == 503:
        return Refused(f"The collector's store is not available (503): {message}")
    return Refused(f"The collector answered {r.status_code} for {where}: {message}")


def frame(body: dict[str, Any]) -> pd.DataFrame:
    """An API answer as a DataFrame; ISO 8601 time columns become UTC timestamps."""
    df = pd.DataFrame(body.get("rows", []), columns=body.get("columns", []))
    for col in df.columns:
        if not (df[col].dtype == object or pd.api.types.is_string_dtype(df[col])):
            continue
        first = df[col].dropna()
        if not first.empty and isinstance(first.iloc[0], str) and _ISO.match(first.iloc[0]):
            df[col] = pd.to_datetime(df[col], utc=True, format="ISO8601")
    return df


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def health(api: Api) -> dict[str, Any]:
    """`GET /health`: status, store up/down, spool figures."""
    return api.call("GET", "/health")


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def sql(api: Api, text: str, params: dict[str, Any] | None = None) -> pd.DataFrame:
    """Run one of `dashboard.queries` through `POST /api/sql`."""
    return frame(api.call("POST", "/api/sql", json={"sql": text, "params": params or {}}))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def requests(api: Api, trace_id: str) -> pd.DataFrame:
    """`GET /api/requests?trace_id=`: the request row(s) of one trace."""
    return frame(api.call("GET", "/api/requests", params={"trace_id": trace_id, "limit": 10}))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def trace(api: Api, trace_id: str) -> pd.DataFrame:
    """`GET /api/traces/{id}`: every span of one trace, oldest first."""
    return frame(api.call("GET", f"/api/traces/{trace_id}"))
