"""The read-only query API under /api: recent requests, steps, percentile series, one trace, and
`POST /api/sql` for post-incident questions (ClickHouse readonly=1, time and row limits).

Every answer is `{"columns": [...], "rows": [[...], ...]}` (plus `truncated` for /api/sql), times as
ISO 8601 UTC strings, NaN as null.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import uuid
from decimal import Decimal
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from collector import queries
from collector.errors import HTTPProblem
from collector.store import QueryError, QueryResult, Store, StoreError

router = APIRouter(prefix="/api")


class SqlRequest(BaseModel):
    sql: str = Field(min_length=1, max_length=100_000)
    params: dict[str, Any] | None = None


def _problem(status: int, message: str) -> Exception:
    return HTTPProblem(status, message)


def _store(request: Request) -> Store:
    ingestor = request.app.state.ingestor
    if ingestor.store is None:
        raise _problem(503, f"the store is not available: {ingestor.store_error or 'starting'}")
    return ingestor.store


async def _run(request: Request, sql: queries.Sql) -> dict[str, Any]:
    store = _store(request)
    try:
        result = await run_in_threadpool(store.query, sql.text, sql.parameters)
    except QueryError as e:
        raise _problem(400, str(e)) from None
    except StoreError as e:
        raise _problem(503, str(e)) from None
    return jsonable(result)


@router.post("/sql")
async def sql(request: Request, body: SqlRequest) -> dict[str, Any]:
    """Any SELECT, run under ClickHouse's readonly=1 with the collector's time and row limits."""
    config = request.app.state.config
    store = _store(request)
    try:
        result = await run_in_threadpool(
            store.query_readonly,
            body.sql,
            max_rows=config.query_max_rows,
            timeout_s=config.query_timeout_s,
            parameters=body.params,
        )
    except QueryError as e:
        raise _problem(400, str(e)) from None
    except StoreError as e:
        raise _problem(503, str(e)) from None
    return jsonable(result)


@router.get("/requests")
async def requests(
    request: Request,
    since: float | None = Query(None, description="epoch seconds"),
    until: float | None = Query(None, description="epoch seconds"),
    service: str | None = None,
    instance: str | None = None,
    role: str | None = None,
    model: str | None = None,
    trace_id: str | None = None,
    finish_reason: str | None = None,
    min_ttft_s: float | None = None,
    min_e2e_s: float | None = None,
    is_error: bool | None = None,
    limit: int = Query(100, ge=1, le=100_000),
) -> dict[str, Any]:
    """Recent requests (one row per llm_request span), newest first."""
    filters = {
        "since": since,
        "until": until,
        "service": service,
        "instance": instance,
        "role": role,
        "model": model,
        "trace_id": trace_id,
        "finish_reason": finish_reason,
        "min_ttft_s": min_ttft_s,
        "min_e2e_s": min_e2e_s,
        "is_error": None if is_error is None else int(is_error),
    }
    return await _run(request, queries.recent_requests(filters, limit))


@router.get("/steps")
async def steps(
    request: Request,
    since: float | None = Query(None, description="epoch seconds"),
    until: float | None = Query(None, description="epoch seconds"),
    service: str | None = None,
    instance: str | None = None,
    role: str | None = None,
    model: str | None = None,
    trace_id: str | None = None,
    min_batch_size: int | None = Query(None, ge=0),
    limit: int = Query(1000, ge=1, le=100_000),
) -> dict[str, Any]:
    """Recent engine steps, newest first."""
    filters = {
        "since": since,
        "until": until,
        "service": service,
        "instance": instance,
        "role": role,
        "model": model,
        "trace_id": trace_id,
        "min_batch_size": min_batch_size,
    }
    return await _run(request, queries.recent_steps(filters, limit))


@router.get("/percentiles")
async def percentiles(
    request: Request,
    interval_s: int = Query(10, ge=1, le=86_400),
    metrics: str = Query(
        "ttft_s,tpot_s,e2e_s", description=f"comma-separated, from {queries.LATENCY_METRICS}"
    ),
    since: float | None = None,
    until: float | None = None,
    service: str | None = None,
    instance: str | None = None,
    role: str | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """P50/P90/P99 of TTFT, TPOT and E2E (or `metrics`) per interval."""
    names = tuple(m.strip() for m in metrics.split(",") if m.strip())
    unknown = [m for m in names if m not in queries.LATENCY_METRICS]
    if unknown or not names:
        raise _problem(400, f"unknown metric(s) {unknown}: choose from {list(queries.LATENCY_METRICS)}")
    filters = {
        "since": since,
        "until": until,
        "service": service,
        "instance": instance,
        "role": role,
        "model": model,
    }
    return await _run(request, queries.percentiles(filters, interval_s, names))


@router.get("/traces/{trace_id}")
async def trace(
    request: Request, trace_id: str, limit: int = Query(10_000, ge=1, le=100_000)
) -> dict[str, Any]:
    """Every span of one trace, oldest first (404 if the trace is unknown)."""
    if len(trace_id) != 32 or any(c not in "0123456789abcdefABCDEF" for c in trace_id):
        raise _problem(400, "a trace id is 32 hex digits")
    bounds = await _run(request, queries.Sql(queries.TRACE_BOUNDS, {"trace_id": trace_id}))
    start, end, found = bounds["rows"][0]
    if not found:
        raise _problem(404, f"trace {trace_id} not found")
    store = _store(request)
    params = {"trace_id": trace_id, "start": _parse_iso(start), "end": _parse_iso(end), "limit": limit}
    try:
        result = await run_in_threadpool(store.query, queries.TRACE_SPANS, params)
    except QueryError as e:
        raise _problem(400, str(e)) from None
    if not result.rows:
        raise _problem(404, f"trace {trace_id} not found")
    return jsonable(result)


def _parse_iso(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).replace(tzinfo=None)


def jsonable(result: QueryResult) -> dict[str, Any]:
    """A QueryResult as the API's JSON: times as ISO 8601 UTC, NaN/inf as null, bytes as base64."""
    out: dict[str, Any] = {
        "columns": result.columns,
        "rows": [[_value(v) for v in row] for row in result.rows],
    }
    if result.truncated:
        out["truncated"] = True
    return out


def _value(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dt.datetime):
        if v.tzinfo is not None:
            v = v.astimezone(dt.UTC).replace(tzinfo=None)
        return v.isoformat() + "Z"
    if isinstance(v, dt.date):
        return v.isoformat()
    if isinstance(v, list | tuple):
        return [_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _value(x) for k, x in v.items()}
    if isinstance(v, Decimal):
        return float(v)
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, bytes | bytearray):
        return base64.b64encode(bytes(v)).decode()
    return str(v)
