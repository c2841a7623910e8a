"""The collector's HTTP service: OTLP/HTTP receiver (`/v1/traces`, `/v1/metrics`, `/v1/logs`), `/health`,
and the read-only query API under `/api` (collector/api.py).

Status codes follow the OTLP/HTTP specification: 200 (with `partial_success` when items were rejected),
400 malformed, 401 without the token, 413 too large, 415 other media types, 429/503 with Retry-After.
"""

from __future__ import annotations

import gc
import hmac
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from collector import otlp
from collector.api import router as api_router
from collector.config import CollectorConfig
from collector.errors import HTTPProblem
from collector.ingest import Backpressure, Ingestor
from collector.scrape import Scraper
from collector.sglang import SglangAssembler
from collector.spool import Spool
from collector.store import StoreError

log = logging.getLogger(__name__)

DRAIN_CAP_BYTES = 1 << 30  # an oversized body is read and discarded up to here, so the client sees the 413


class Stoppable(Protocol):
    def stop(self) -> None: ...


# A background task of the collector: started with the ingestor (its store open) and the config, after the
# ingestor starts; stopped before it stops. `stepscope collector --alert-rules` passes the alert evaluator.
BackgroundTask = Callable[[Ingestor, CollectorConfig], Stoppable]


def create_app(config: CollectorConfig, *, background: Sequence[BackgroundTask] = ()) -> FastAPI:
    """The collector app; the store and spool are opened on startup and closed on shutdown, and each
    `background` task is started after them and stopped before them."""
    ingestor = Ingestor(
        config.store,
        Spool(config.spool or "stepscope-spool", config.spool_max_bytes),
        ttl_days=config.ttl_days,
        max_inflight=config.max_inflight,
        retry_after_s=config.retry_after_s,
        convert_workers=config.convert_workers,
    )

    targets = config.scrape_targets()
    scraper = Scraper(targets, config.scrape_interval_s, _store_inserter(ingestor)) if targets else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(ingestor.start)
        running: list[Stoppable] = []
        try:
            if scraper is not None:
                scraper.start()
                running.append(scraper)
            running.append(SglangAssembler.start(ingestor, config))
            for start in background:
                running.append(await run_in_threadpool(start, ingestor, config))
            # Everything loaded so far (modules, the store's client) lives as long as the process: keeping
            # it out of the cyclic collector's scans saves each full collection traversing it again.
            gc.freeze()
            yield
        finally:
            for task in reversed(running):
                await run_in_threadpool(task.stop)
            await run_in_threadpool(ingestor.stop)

    app = FastAPI(title="stepscope collector", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.ingestor = ingestor
    app.state.scraper = scraper
    expected = f"Bearer {config.token}".encode() if config.token else None

    async def authenticate(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            await _drain(request)
            raise HTTPProblem(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    def ingest(signal: str, body: bytes, content_type: str | None, encoding: str | None) -> tuple[str, bytes]:
        kind = otlp.media_type(content_type)
        body = otlp.decompress(body, encoding, config.max_body_bytes)
        # protobuf traces are parsed once, by their converter (convert.traces_payload), not here too
        decoded = otlp.decode(signal, body, kind, parse=signal != "traces")
        outcome = ingestor.submit(signal, decoded)
        return kind, otlp.encode_response(signal, kind, outcome.rejected, outcome.error_message)

    @app.exception_handler(HTTPProblem)
    async def problem(request: Request, exc: HTTPProblem) -> Response:
        kind = _reply_kind(request)
        if request.url.path.startswith("/v1/"):
            body = otlp.encode_status(kind, _grpc_code(exc.status), str(exc))
            return Response(body, status_code=exc.status, media_type=kind, headers=exc.headers)
        return JSONResponse({"error": str(exc)}, status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health() -> dict[str, object]:
        out: dict[str, object] = {"status": "ok", **ingestor.status()}
        if scraper is not None:
            out["scrape"] = scraper.status()
        return out

    # A plain Starlette route, not a FastAPI one: FastAPI's dependency and parameter solving costs more per
    # request than the rest of the event loop's share of an export (docs/collector.md, "The ingest path").
    async def export(request: Request) -> Response:
        await authenticate(request)
        signal = request.path_params["signal"]
        if signal not in otlp.SIGNALS:
            await _drain(request)
            raise HTTPProblem(404, f"unknown signal {signal!r}: use /v1/traces, /v1/metrics or /v1/logs")
        body = await _read_body(request, config.max_body_bytes)
        headers = request.headers
        try:
            kind, reply = await run_in_threadpool(
                ingest, signal, body, headers.get("content-type"), headers.get("content-encoding")
            )
        except otlp.UnsupportedMediaType as e:
            raise HTTPProblem(415, str(e)) from None
        except otlp.PayloadTooLarge as e:
            raise HTTPProblem(413, str(e)) from None
        except otlp.PayloadError as e:
            raise HTTPProblem(400, str(e)) from None
        except Backpressure as e:
            raise HTTPProblem(e.status, str(e), {"Retry-After": str(e.retry_after_s)}) from None
        return Response(reply, status_code=200, media_type=kind)

    app.add_route("/v1/{signal}", export, methods=["POST"], include_in_schema=False)
    app.include_router(api_router, dependencies=[Depends(authenticate)])
    return app


def _store_inserter(ingestor: Ingestor) -> Callable[[Any], None]:
    """Scraped rows go straight into the store (nobody waits for an acknowledgement); while it is down
    the scraper keeps them (bounded) and tries again next round."""

    def insert(table: Any) -> None:
        store = ingestor.store
        if store is None:
            raise StoreError(f"the store is not available: {ingestor.store_error or 'starting'}")
        store.insert("engine_samples", table.column_names, table)

    return insert


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(request)
        raise HTTPProblem(413, f"body of {declared} bytes is over the {limit} byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _drain(request, size)
            raise HTTPProblem(413, f"body is over the {limit} byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request: Request, seen: int = 0) -> None:
    """Read and discard what the client is still sending, so that it reads our answer instead of a reset."""
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > DRAIN_CAP_BYTES:
                break
    except Exception:  # the stream may already be consumed or closed; nothing to drain then
        return


def _reply_kind(request: Request) -> str:
    try:
        return otlp.media_type(request.headers.get("content-type"))
    except otlp.UnsupportedMediaType:
        return otlp.JSON


def _grpc_code(status: int) -> int:
    # google.rpc.Code of the Status body: INVALID_ARGUMENT, UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...
    return {400: 3, 401: 16, 404: 5, 413: 8, 415: 3, 429: 8, 503: 14}.get(status, 2)
