"""The HTTP front end: OpenAI-compatible routes, tokenization, detokenization, stop strings, SSE.

It runs in its own process beside the engine core (`engine/core_proc.py`) and talks to it over the
RPC channel through `AsyncEngineClient` (engine/core_client.py): one asyncio task reads the core's
OUTPUTS frames and hands each request's outputs to that request's queue. Every refusal is an
OpenAI-shaped error.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import EngineConfig
from engine.core_client import AsyncEngineClient, CoreProcess
from engine.engine_client import CoreError, EngineClient, OutputQueue, RpcDelay
from engine.faults import FaultSettings
from engine.loop_lag import LoopLag
from engine.metrics import ServerMetrics
from engine.openai_protocol import (
    DEFAULT_MAX_TOKENS,
    SSE_DONE,
    APIError,
    GenerateRequest,
    StopStrings,
    chat_body,
    chat_chunk,
    completion_body,
    parse_chat,
    parse_completion,
    parse_json,
    sse,
    usage,
)
from engine.request import EngineRequest, RequestTimings
from engine.tokenizer import IncrementalDetokenizer, get_tokenizer

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from instrumentation.request_spans import RequestTrace, RequestTracer

MAX_BODY_BYTES = 8 * 2**20  # a request body beyond this is refused with 413 before it is parsed
_TOKENIZE_IN_THREAD_CHARS = 4096  # longer prompts are tokenized off the event loop


@dataclass(slots=True)
class ServerSettings:
    """Front-end settings; engine knobs live in `EngineConfig`."""

    served_model_name: str
    max_waiting: int
    admin_token: str | None = None
    otlp_endpoint: str | None = None  # carried for the instrumentation
    max_body_bytes: int = MAX_BODY_BYTES
    telemetry: RequestTracer | None = None  # instrumentation.request_spans; None: tracing off


@dataclass(slots=True)
class _Tally:
    """One request's counts, filled while it streams."""

    prompt_tokens: int
    arrival: float  # time.monotonic() when the request arrived
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    counted: bool = False  # finished and counted in the metrics
    trace: RequestTrace | None = None  # the request's span, when tracing is on
    error: str | None = None
    rpc_delay: RpcDelay | None = None  # core produced a token -> front end received it
    output_queue: OutputQueue | None = None  # the client's queue for this request
    timings: RequestTimings | None = None  # the core's timestamps, as of the latest output


class OpenAIServer:
    """Route handlers and the state they share. `build_app` wires them into FastAPI."""

    def __init__(
        self,
        core: CoreProcess | None,
        settings: ServerSettings,
        on_core_exit: Callable[[str], None],
        client: EngineClient | None = None,
    ) -> None:
        self.settings = settings
        # The engine behind the API: the local core process, or another client (engine/engine_client.py).
        self.client: EngineClient = client if client is not None else AsyncEngineClient(core, on_core_exit)
        self.info = self.client.info
        self.tokenizer = get_tokenizer(str(self.info["model"]), int(self.info["vocab_size"]))
        self.max_model_len = int(self.info["max_model_len"])
        self.metrics = ServerMetrics(settings.served_model_name)
        self.metrics.set_engine_info(self.info)
        self.client.watch_steps(self.metrics.iteration_tokens.observe)
        self.created = int(time.time())
        self.faults = FaultSettings()  # engine/faults.py, set through /admin/faults
        self.loop_lag = LoopLag()
        self.telemetry = settings.telemetry
        if self.telemetry is not None:
            self.telemetry.watch_engine(lambda: self.client.stats)

    # -- plain routes --------------------------------------------------------------------------
    async def health(self) -> Response:
        body = self.client.health_report()  # a router lists its workers
        if body is not None:
            return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)
        return Response(status_code=200 if self.client.alive else 503)

    async def models(self) -> dict[str, object]:
        card = {
            "id": self.settings.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "stepscope",
            "root": str(self.info["model"]),
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def metrics_text(self) -> PlainTextResponse:
        text = self.metrics.render(self.client.stats, self.client.num_inflight)
        text += self.client.extra_metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- admin -----------------------------------------------------------------------------------
    async def get_limits(self, request: Request) -> dict[str, object]:
        self._check_admin(request)
        limits = await self.client.admin(None)
        self.metrics.set_engine_info({"limits": limits})
        return limits

    async def set_limits(self, request: Request) -> dict[str, object]:
        self._check_admin(request)
        changes = parse_json(await self._read_body(request))
        kinds = {f.name: type(f.default) for f in fields(EngineConfig)}
        for name, value in changes.items():
            if name not in EngineConfig.runtime_fields():
                allowed = ", ".join(EngineConfig.runtime_fields())
                raise APIError(400, f"not a runtime knob: {name}; allowed: {allowed}", name)
            if type(value) is not kinds[name]:
                raise APIError(400, f"{name} must be of type {kinds[name].__name__}", name)
        try:
            limits = await self.client.admin(changes)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self.metrics.set_engine_info({"limits": limits})
        return limits

    async def get_faults(self, request: Request) -> dict[str, object]:
        self._check_admin(request)
        return self.faults.to_dict()

    async def set_faults(self, request: Request) -> dict[str, object]:
        """Switch the engine-side faults (docs/faults.md); the body is the whole fault state, `{}` clears."""
        self._check_admin(request)
        try:
            settings = FaultSettings.from_json(parse_json(await self._read_body(request)))
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        try:
            reply = await self.client.set_faults(settings.to_dict())
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self.faults = settings
        return reply

    def _check_admin(self, request: Request) -> None:
        token = self.settings.admin_token
        if not token:
            raise APIError(
                403, "admin API disabled: start the server with --admin-token", type="permission_error"
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise APIError(
                401, "missing or wrong admin token", code="invalid_api_key", type="authentication_error"
            )

    # -- generation ------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival_ns = time.monotonic_ns()
        gen = parse_completion(parse_json(await self._read_body(request)))
        return await self._serve(request, gen, arrival_ns, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        arrival_ns = time.monotonic_ns()
        gen = parse_chat(parse_json(await self._read_body(request)))
        return await self._serve(request, gen, arrival_ns, chat=True)

    async def _serve(self, request: Request, gen: GenerateRequest, arrival_ns: int, chat: bool) -> Response:
        if gen.model is not None and gen.model != self.settings.served_model_name:
            raise APIError(404, f"the model {gen.model!r} does not exist", "model", "model_not_found")
        prompt_ids = await self._prompt_ids(gen)
        max_tokens = self._max_tokens(gen, len(prompt_ids), chat)
        self._admit()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        engine_req = EngineRequest(
            rid,
            prompt_ids,
            gen.sampling(max_tokens),
            arrival_ns=arrival_ns,  # the core's clock is the same CLOCK_MONOTONIC
            cache_salt=gen.cache_salt,
            trace_context=request.headers.get("traceparent", ""),
        )
        trace = self._start_trace(rid, arrival_ns, request, gen, engine_req)
        if trace is not None:  # the core's phase spans hang on our span, not the caller's
            engine_req.trace_context = trace.traceparent
        tally = _Tally(len(prompt_ids), arrival_ns / 1e9, trace=trace)
        if trace is not None:
            trace.handoff_ns = time.monotonic_ns()  # the front end's part of TTFT ends here
        queue = self.client.add(engine_req)  # no await since _admit: the count stays exact
        tally.rpc_delay, tally.output_queue = queue.rpc_delay, queue
        finish = functools.partial(self._finish, rid, tally)
        deltas = self._generate(queue, gen.stop, tally, finish)
        if gen.stream:
            chunks = self._sse(deltas, rid, chat, gen.include_usage, tally)
            return _AbortingStream(chunks, finish, media_type="text/event-stream")
        try:
            text = await _until_disconnect(request, _join(deltas))
        finally:
            finish()
        use = usage(tally.prompt_tokens, tally.completion_tokens, tally.cached_tokens)
        model, created = self.settings.served_model_name, int(time.time())
        if chat:
            return JSONResponse(chat_body(rid, created, model, text, tally.finish_reason, use))
        return JSONResponse(completion_body(rid, created, model, text, tally.finish_reason, use))

    def _start_trace(
        self, rid: str, arrival_ns: int, request: Request, gen: GenerateRequest, req: EngineRequest
    ) -> RequestTrace | None:
        """The request's `llm_request` span, started at its arrival (None with tracing off)."""
        if self.telemetry is None:
            return None
        return self.telemetry.start(
            rid,
            arrival_ns,
            request.headers.get("traceparent"),
            model=self.settings.served_model_name,
            operation="chat" if gen.messages is not None else "text_completion",
            max_tokens=req.sampling.max_tokens,
            temperature=req.sampling.temperature,
            top_p=req.sampling.top_p,
            prompt_ids=req.prompt_token_ids,
            block_size=int(self.info["block_size"]),
            cache_salt=req.cache_salt,
        )

    async def _prompt_ids(self, gen: GenerateRequest) -> list[int]:
        if gen.prompt_token_ids is not None:
            vocab = int(self.info["vocab_size"])
            if any(not 0 <= t < vocab for t in gen.prompt_token_ids):
                raise APIError(400, f"token ids must be in [0, {vocab})", "prompt")
            return gen.prompt_token_ids
        if gen.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(gen.messages)
            except ValueError as e:
                raise APIError(400, str(e), "messages") from None
        else:
            text = gen.prompt
        if len(text) > _TOKENIZE_IN_THREAD_CHARS:
            ids = await asyncio.to_thread(self.tokenizer.encode, text)
        else:
            ids = self.tokenizer.encode(text)
        for _ in range(self.faults.frontend_cpu):  # the frontend_cpu fault: real work on the loop
            self.tokenizer.encode(text)
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        return ids

    def _max_tokens(self, gen: GenerateRequest, num_prompt: int, chat: bool) -> int:
        """The request's max_tokens; chat defaults to the rest of the context (as vLLM does)."""
        max_tokens = gen.max_tokens
        if max_tokens is None:
            max_tokens = max(self.max_model_len - num_prompt, 1) if chat else DEFAULT_MAX_TOKENS
        if num_prompt + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in "
                "the completion). Please reduce the length of the prompt or completion.",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        blocks = -(-(num_prompt + 1) // int(self.info["block_size"]))
        if blocks > self.client.num_kv_blocks:
            raise APIError(
                400, f"the prompt needs {blocks} KV blocks; the pool has {self.client.num_kv_blocks}"
            )
        return max_tokens

    def _admit(self) -> None:
        """429 when the waiting queue is full: the core's count, or the front end's if that is larger."""
        if not self.client.alive:
            raise APIError(503, "the engine core is not running", type="server_error")
        if self.client.num_waiting >= self.settings.max_waiting:
            self.metrics.count_rejected(429)
            raise APIError(
                429,
                f"the server is overloaded: {self.client.num_waiting} requests waiting (limit "
                f"{self.settings.max_waiting}); retry later",
                code="rate_limit_exceeded",
                type="rate_limit_error",
            )

    async def _generate(
        self, queue: asyncio.Queue, stop: list[str], tally: _Tally, finish: Callable[[], None]
    ) -> AsyncIterator[str]:
        """The request's text as it arrives, stop strings applied; `finish()` when it ends."""
        detok, stops = IncrementalDetokenizer(self.tokenizer), StopStrings(stop)
        last = None
        try:
            while tally.finish_reason is None:
                out = await queue.get()
                if isinstance(out, Exception):
                    tally.error = str(out)
                    raise out
                if tally.trace is not None:
                    tally.trace.observe(out)
                now = time.monotonic()
                if out.new_token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - tally.arrival)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                tally.completion_tokens += len(out.new_token_ids)
                tally.cached_tokens = out.num_cached_tokens
                tally.timings = out.timings
                text = stops.push(detok.push(out.new_token_ids))
                if not stops.stopped and out.finished:
                    text += stops.push(detok.flush())
                    text += "" if stops.stopped else stops.flush()
                if stops.stopped or out.finished:
                    tally.finish_reason = "stop" if stops.stopped else out.finish_reason
                if text:
                    yield text
        finally:
            finish()

    def _finish(self, req_id: str, tally: _Tally) -> None:
        """Once per request, however it ends: abort it in the core if it still runs (stop string,
        client gone, error), then count it."""
        if tally.counted:
            return
        tally.counted = True
        if not self.client.is_finished(req_id):
            self.client.abort(req_id)  # frees its KV blocks at the core's next step
            tally.finish_reason = tally.finish_reason or "abort"
        self.metrics.e2e.observe(time.monotonic() - tally.arrival)
        queue = tally.output_queue
        if tally.timings is not None:
            self.metrics.observe_phases(tally.timings, queue.kv_transfer_ns if queue is not None else 0)
        reason = tally.finish_reason or "abort"
        self.metrics.count_finished(reason, tally.prompt_tokens, tally.completion_tokens)
        if tally.trace is not None:
            if tally.rpc_delay is not None and tally.rpc_delay.count:
                tally.trace.span.set_attributes(_rpc_attributes(tally.rpc_delay))
            tally.trace.kv_transfer_ns = queue.kv_transfer_ns if queue is not None else 0
            tally.trace.loop_lag_s = self.loop_lag.worst_since(tally.trace.arrival_ns)
            self.telemetry.finish(tally.trace, reason, tally.error)

    async def _sse(
        self, deltas: AsyncIterator[str], rid: str, chat: bool, include_usage: bool, tally: _Tally
    ) -> AsyncIterator[bytes]:
        model, created = self.settings.served_model_name, int(time.time())
        try:
            if chat:
                yield sse(chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
            async for text in deltas:
                if chat:
                    yield sse(chat_chunk(rid, created, model, {"content": text}))
                else:
                    yield sse(completion_body(rid, created, model, text, None))
            if chat:
                yield sse(chat_chunk(rid, created, model, {}, tally.finish_reason))
            else:
                yield sse(completion_body(rid, created, model, "", tally.finish_reason))
            if include_usage:
                use = usage(tally.prompt_tokens, tally.completion_tokens, tally.cached_tokens)
                if chat:
                    yield sse(chat_chunk(rid, created, model, None, usage_=use))
                else:
                    yield sse(completion_body(rid, created, model, None, None, use))
        except CoreError as e:  # the status line is long gone: report in the stream, as vLLM does
            yield sse(_core_error(e).body())
        finally:
            await deltas.aclose()
        yield SSE_DONE

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes")
        return bytes(body)


class _AbortingStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends, so a gone client's request is aborted
    at once rather than when the garbage collector closes the generator."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kw: object) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"}, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()


async def _join(deltas: AsyncIterator[str]) -> str:
    return "".join([t async for t in deltas])


async def _until_disconnect(request: Request, work: object) -> str:
    """Await `work`, cancelling it if the client disconnects first (its finally aborts the request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise APIError(499, "client disconnected")
    exc = task.exception()
    if isinstance(exc, CoreError):
        raise _core_error(exc) from None
    return task.result()


def _rpc_attributes(delay: RpcDelay) -> dict[str, float]:
    from instrumentation.attributes import RPC_DELAY_MAX_S, RPC_DELAY_MEAN_S  # constants only, no OTel

    return {RPC_DELAY_MEAN_S: delay.mean_s, RPC_DELAY_MAX_S: delay.max_s}


def _core_error(e: CoreError) -> APIError:
    """The core refused the request (400), the core is gone (500), or a status the client chose (503:
    no healthy worker of a role, when disaggregated)."""
    if e.status:
        return APIError(e.status, str(e), type="server_error")
    return APIError(500, str(e), type="server_error") if e.fatal else APIError(400, str(e))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(
    core: CoreProcess | None,
    settings: ServerSettings,
    on_core_exit: Callable[[str], None],
    client: EngineClient | None = None,
) -> FastAPI:
    """The FastAPI app over a started core process (`on_core_exit(reason)` runs if it dies), or over
    another engine client (`core` None: the disaggregated router's, engine/disagg/router.py)."""
    server = OpenAIServer(core, settings, on_core_exit, client)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.client.start()
        server.loop_lag.start()
        yield
        await server.loop_lag.stop()
        await server.client.close()

    app = FastAPI(title="stepscope", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/admin/limits", server.get_limits, methods=["GET"])
    app.add_api_route("/admin/limits", server.set_limits, methods=["POST"])
    app.add_api_route("/admin/faults", server.get_faults, methods=["GET"])
    app.add_api_route("/admin/faults", server.set_faults, methods=["POST"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    return app
