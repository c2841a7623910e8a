"""The fleet router's HTTP front: the OpenAI routes proxied to a replica chosen by the routing policy.

    POST /v1/completions, /v1/chat/completions
      body -> prompt token ids (the replicas' tokenizer) -> chained block hashes -> Router.choose
      `route` span (the caller's traceparent is its parent) -> the replica gets the request with the
      route span's traceparent (its llm_request is the route's child) -> the response streams back
    a replica that cannot be reached before it answers is marked down and the request goes to another
    (at most MAX_ATTEMPTS in all); one that fails mid-response ends the stream with an error event.

/admin/limits and /admin/faults fan out to every replica, or to one with `"instance": ID` (an unknown id
is a 400 that changes nothing). The router's own faults (cache_affinity_lost, routing_skew) live in the
/admin/faults body too (docs/faults.md). /health lists the replicas; a health loop marks a replica down
when its process exited, its port refuses connections or its /health says 503, and up again when it
answers 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from engine.faults import FaultSettings
from engine.fleet.routing import Replica, Router, RouterFaults
from engine.openai_protocol import APIError, GenerateRequest, parse_chat, parse_completion, sse
from engine.tokenizer import Tokenizer

MAX_ATTEMPTS = 3  # a request tries at most this many replicas that could not be reached
HEALTH_EVERY_S = 1.0
HEALTH_TIMEOUT_S = 5.0  # a replica busy with a long step answers late; late is not down
ADMIN_TIMEOUT_S = 60.0
ROUTER_FAULTS = ("cache_affinity_lost", "routing_skew")


@dataclass(slots=True)
class FleetSettings:
    """What the router needs to know of the replicas it fronts."""

    served_model_name: str
    block_size: int
    admin_token: str | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # by instance, when we started them


class FleetRouter:
    """Route handlers and the state they share; `build_router_app` wires them into FastAPI."""

    def __init__(
        self, router: Router, tokenizer: Tokenizer, settings: FleetSettings, tracer: object | None = None
    ) -> None:
        self.router, self.tokenizer, self.settings, self.tracer = router, tokenizer, settings, tracer
        self.retries = self.failures = 0
        self.http: httpx.AsyncClient | None = None  # health checks and admin fan-out
        self.upstream: aiohttp.ClientSession | None = None  # the generation requests
        self._health: asyncio.Task | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        # Headers and body go out as two writes: with Nagle on, the body waits for the replica's delayed
        # ACK of the headers (~40 ms on Linux loopback) before the replica can start on the request.
        nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=nodelay)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), transport=transport)
        # The proxied requests go through aiohttp (its parser is compiled; it sets TCP_NODELAY itself):
        # httpx, httpcore, anyio and h11 cost ~1,000 Python calls and ~3 ms of CPU a request here, most of
        # the router's 5 ms. Bodies pass through as bytes, compressed or not.
        self.upstream = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, connect=5.0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self._health = asyncio.ensure_future(self._health_loop())

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
        if self.http is not None:
            await self.http.aclose()
        if self.upstream is not None:
            await self.upstream.close()

    # -- generation ------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/completions", parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/chat/completions", parse_chat)

    async def _proxy(self, request: Request, path: str, parse: object) -> Response:
        body = await request.body()
        hashes = self._hashes(body, parse)
        span, traceparent = (None, request.headers.get("traceparent"))
        if self.tracer is not None:
            span, traceparent = self.tracer.start(traceparent)
        headers = {"content-type": "application/json"}
        if traceparent:
            headers["traceparent"] = traceparent
        tried: set[str] = set()
        while True:
            decision = self.router.choose(hashes, frozenset(tried))
            if decision is None:
                self.failures += 1
                return self._give_up(span, "no healthy replica" + (" left" if tried else ""))
            replica = decision.replica
            if span is not None:
                self.tracer.chosen(span, decision, len(tried) + 1)
            self.router.started(decision, hashes)
            try:
                resp = await self.upstream.post(replica.url + path, data=body, headers=headers)
                break
            except (aiohttp.ClientError, TimeoutError) as e:
                self.router.finished(replica)
                self._down(replica, f"unreachable: {e!r}")
                tried.add(replica.instance)
                if len(tried) >= MAX_ATTEMPTS:
                    self.failures += 1
                    return self._give_up(span, f"{len(tried)} replicas failed; the last: {e!r}")
                self.retries += 1
        stream = resp.headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(
            self._relay(resp, replica, span, stream),
            status_code=resp.status,
            media_type=resp.headers.get("content-type"),
        )

    async def _relay(
        self, resp: aiohttp.ClientResponse, replica: Replica, span: object, stream: bool
    ) -> AsyncIterator[bytes]:
        error = f"HTTP {resp.status}" if resp.status >= 500 else None
        try:
            async for chunk in resp.content.iter_any():
                yield chunk
        except aiohttp.ClientError as e:
            error = f"the replica {replica.instance} failed mid-response: {e!r}"
            self.failures += 1
            self._down(replica, error)
            if stream:
                yield sse(APIError(502, error, type="server_error").body())
        finally:
            resp.release()  # back to the pool when read to the end; closed (the replica aborts) when not
            self.router.finished(replica)
            if span is not None:
                self.tracer.end(span, error)

    def _give_up(self, span: object, reason: str) -> Response:
        if span is not None:
            self.tracer.end(span, reason)
        return JSONResponse(APIError(503, reason, type="server_error").body(), status_code=503)

    def _hashes(self, body: bytes, parse: object) -> list[int]:
        """The prompt's chained block hashes; [] when the body does not parse (the replica will say why)."""
        try:
            gen: GenerateRequest = parse(json.loads(body))
            ids = gen.prompt_token_ids
            if ids is None:
                text = self.tokenizer.apply_chat_template(gen.messages) if gen.messages else gen.prompt
                ids = self.tokenizer.encode(text)
            return self.router.hashes(ids, self.settings.block_size, gen.cache_salt)
        except (APIError, ValueError, TypeError, AttributeError):
            return []

    # -- replicas' health ------------------------------------------------------------------------
    def _down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            replica.healthy = False
            print(f"stepscope router: replica {replica.instance} is down: {reason}", file=sys.stderr)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in self.router.replicas))
            await asyncio.sleep(HEALTH_EVERY_S)

    async def _check(self, replica: Replica) -> None:
        proc = self.settings.procs.get(replica.instance)
        if proc is not None and proc.poll() is not None:
            self._down(replica, f"its process exited ({proc.returncode})")
            return
        try:
            resp = await self.http.get(replica.url + "/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.TimeoutException:
            return
        except httpx.TransportError as e:
            self._down(replica, f"unreachable: {e!r}")
            return
        if resp.status_code == 200 and not replica.healthy:
            replica.healthy = True
            print(f"stepscope router: replica {replica.instance} is up", file=sys.stderr)
        elif resp.status_code != 200:
            self._down(replica, f"/health answered {resp.status_code}")

    # -- plain routes ----------------------------------------------------------------------------
    async def health(self) -> Response:
        replicas = []
        for r in self.router.replicas:
            proc = self.settings.procs.get(r.instance)
            state = "healthy" if r.healthy else "down"
            if proc is not None and proc.poll() is not None:
                state = "dead"
            replicas.append(
                {
                    "instance": r.instance,
                    "url": r.url,
                    "pid": r.pid,
                    "state": state,
                    "load": r.load,
                    "routed": r.routed,
                }
            )
        ok = any(r.healthy for r in self.router.replicas)
        body = {"status": "ok" if ok else "unhealthy", "routing": self.router.policy, "replicas": replicas}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(self) -> Response:
        for r in self.router.replicas:
            if r.healthy:
                with contextlib.suppress(httpx.TransportError):
                    resp = await self.http.get(r.url + "/v1/models")
                    return Response(resp.content, resp.status_code, media_type="application/json")
        raise APIError(503, "no healthy replica", type="server_error")

    async def metrics_text(self) -> PlainTextResponse:
        lines = ["# TYPE stepscope:router_requests_in_flight gauge"]
        lines += [f'stepscope:router_requests_in_flight{{instance="{r.instance}"}} {r.load}' for r in
                  self.router.replicas]  # fmt: skip
        lines.append("# TYPE stepscope:router_routed_total counter")
        lines += [f'stepscope:router_routed_total{{instance="{r.instance}"}} {r.routed}' for r in
                  self.router.replicas]  # fmt: skip
        lines.append("# TYPE stepscope:router_replicas gauge")
        for state, want in (("healthy", True), ("down", False)):
            n = sum(1 for r in self.router.replicas if r.healthy == want)
            lines.append(f'stepscope:router_replicas{{state="{state}"}} {n}')
        for name, value in (("retries", self.retries), ("failures", self.failures)):
            lines += [
                f"# TYPE stepscope:router_{name}_total counter",
                f"stepscope:router_{name}_total {value}",
            ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # -- admin -----------------------------------------------------------------------------------
    async def get_limits(self, request: Request) -> dict[str, object]:
        self._check_admin(request)
        targets = self._targets(request.query_params.get("instance"))
        return {r.instance: await self._admin(r, "GET", "/admin/limits", request) for r in targets}

    async def set_limits(self, request: Request) -> dict[str, object]:
        self._check_admin(request)
        body = _json_object(await request.body())
        targets = self._targets(body.pop("instance", None))
        return await self._fan_out(targets, "/admin/limits", body, request)

    async def get_faults(self, request: Request) -> dict[str, object]:
        self._check_admin(request)
        targets = self._targets(request.query_params.get("instance"))
        engine = {r.instance: await self._admin(r, "GET", "/admin/faults", request) for r in targets}
        return {"router": self.router.faults.to_dict(), "instances": engine}

    async def set_faults(self, request: Request) -> dict[str, object]:
        """The whole fault state: the router's own keys set the router; the rest goes to every replica,
        or to `instance` alone (which routing_skew then pins requests to)."""
        self._check_admin(request)
        body = _json_object(await request.body())
        instance = body.pop("instance", None)
        targets = self._targets(instance)
        own = {k: body.pop(k) for k in ROUTER_FAULTS if k in body}
        skew_to = instance or self.router.replicas[0].instance
        try:
            router_faults = RouterFaults(**own, skew_instance=skew_to)
            FaultSettings.from_json(body)  # refuse a bad body before any replica sees it
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e)) from None
        replies = await self._fan_out(targets, "/admin/faults", body, request)
        self.router.faults = router_faults
        return {"router": router_faults.to_dict(), "instances": replies}

    def _targets(self, instance: object) -> list[Replica]:
        if instance is None:
            return list(self.router.replicas)
        replica = self.router.by_instance.get(instance) if isinstance(instance, str) else None
        if replica is None:
            known = ", ".join(self.router.by_instance)
            raise APIError(400, f"unknown instance {instance!r}; known: {known}", "instance")
        return [replica]

    async def _fan_out(
        self, targets: list[Replica], path: str, body: dict[str, object], request: Request
    ) -> dict[str, object]:
        """POST to the first target alone: a refusal there (a bad value) reaches no other replica."""
        first = await self._admin(targets[0], "POST", path, request, body)
        rest = await asyncio.gather(*(self._admin(r, "POST", path, request, body) for r in targets[1:]))
        return dict(zip((r.instance for r in targets), [first, *rest], strict=True))

    async def _admin(
        self, replica: Replica, method: str, path: str, request: Request, body: dict | None = None
    ) -> dict[str, object]:
        headers = {"authorization": request.headers.get("authorization", "")}
        try:
            resp = await self.http.request(
                method, replica.url + path, json=body, headers=headers, timeout=ADMIN_TIMEOUT_S
            )
        except httpx.TransportError as e:
            raise APIError(502, f"replica {replica.instance}: {e!r}", type="server_error") from None
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text
            raise APIError(resp.status_code, f"replica {replica.instance}: {message}")
        return resp.json()

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


def _json_object(raw: bytes) -> dict[str, object]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def build_router_app(fleet: FleetRouter) -> FastAPI:
    """The router's FastAPI app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await fleet.start()
        yield
        await fleet.close()

    app = FastAPI(
        title="stepscope router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.fleet = fleet
    app.add_api_route("/health", fleet.health, methods=["GET"])
    app.add_api_route("/v1/models", fleet.models, methods=["GET"])
    app.add_api_route("/metrics", fleet.metrics_text, methods=["GET"])
    app.add_api_route("/v1/completions", fleet.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", fleet.chat_completions, methods=["POST"])
    app.add_api_route("/admin/limits", fleet.get_limits, methods=["GET"])
    app.add_api_route("/admin/limits", fleet.set_limits, methods=["POST"])
    app.add_api_route("/admin/faults", fleet.get_faults, methods=["GET"])
    app.add_api_route("/admin/faults", fleet.set_faults, methods=["POST"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    return app
