"""One streaming OpenAI request, timed on the client: send, first token, every token chunk, end.

Times are `time.perf_counter()` offsets from the run's start (`t0`), so records of one run compare directly.
A token event is a streamed choice with non-empty text (as vLLM's benchmark counts them: a chat stream's
opening role chunk is not a token). Output tokens come from the final `usage` chunk when the server sends
one (`stream_options.include_usage`), else from the number of token events.

Failures never raise: they are recorded by kind (`ERROR_KINDS`) with a short detail.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field, fields
from typing import Any

import httpx
from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from instrumentation import attributes as A
from loadgen.workloads import RequestSpec

ERROR_KINDS = (
    "http_429",  # the server shed load
    "http_4xx",
    "http_5xx",
    "timeout",  # no complete response within the request timeout
    "connection",  # refused, reset or closed mid-stream
    "stream_error",  # an error object inside the SSE stream
    "protocol",  # a data line that is not JSON
    "empty",  # the stream ended without a token
    "cancelled",  # cut at the end of a step's drain window, or by Ctrl-C
    "client",  # a bug on this side: recorded, so that one request never ends a run
)


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request. Offsets in seconds from the run start; None when not reached."""

    index: int
    kind: str
    max_tokens: int
    prompt_tokens_est: int
    scheduled_s: float  # planned send offset (open loop) or the moment a slot freed (closed loop)
    send_s: float = 0.0
    start_unix_ns: int = 0
    first_token_s: float | None = None
    end_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    finish_reason: str | None = None
    status_code: int | None = None
    error: str | None = None
    error_detail: str = ""
    prefix_changed: bool = False
    trace_id: str = ""

    @property
    def ok(self) -> bool:
        """Completed with at least one token and no error."""
        return self.error is None and self.end_s is not None and self.first_token_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from send."""
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency, from send to the end of the stream."""
        return None if self.end_s is None else self.end_s - self.send_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output tokens - 1), as vLLM defines it."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)  # type: ignore[operator]

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive token events."""
        t = self.token_times_s
        return [b - a for a, b in itertools.pairwise(t)]

    def to_json(self) -> dict[str, Any]:
        """A flat dict for requests.jsonl (derived latencies included, token times kept)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(ok=self.ok, ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return d


def _error_kind_for_status(code: int) -> str:
    if code == 429:
        return "http_429"
    return "http_5xx" if code >= 500 else "http_4xx"


def _token_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


class _StreamError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def _take_chunk(rec: RequestRecord, obj: dict[str, Any], now_s: float) -> None:
    if "error" in obj:
        raise _StreamError("stream_error", str(obj["error"])[:200])
    for choice in obj.get("choices") or []:
        if _token_text(choice):
            if rec.first_token_s is None:
                rec.first_token_s = now_s
            rec.token_times_s.append(now_s)
        rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    usage = obj.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    rec: RequestRecord,
    t0: float,
) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        rec.status_code = resp.status_code
        if resp.status_code >= 400:
            text = (await resp.aread()).decode(errors="replace")
            raise _StreamError(
                _error_kind_for_status(resp.status_code), f"HTTP {resp.status_code}: {text[:200]}"
            )
        saw_usage = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            try:
                obj = json.loads(payload)
            except ValueError:
                raise _StreamError("protocol", f"not JSON: {payload[:100]}") from None
            _take_chunk(rec, obj, time.perf_counter() - t0)
            saw_usage = saw_usage or bool(obj.get("usage"))
        rec.end_s = time.perf_counter() - t0
        if not saw_usage:
            rec.output_tokens = len(rec.token_times_s)
        if rec.first_token_s is None:
            raise _StreamError("empty", "the stream ended without a token")


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    spec: RequestSpec,
    rec: RequestRecord,
    *,
    model: str,
    t0: float,
    timeout_s: float,
    tracer: Tracer | None = None,
) -> RequestRecord:
    """Send `spec` as a streaming request and fill `rec` as it goes (so a cancelled request keeps its
    partial record). Returns `rec`; errors are recorded, never raised (cancellation is re-raised)."""
    headers: dict[str, str] = {}
    span = None
    if tracer is not None:
        span = tracer.start_span(A.SPAN_CLIENT_REQUEST, kind=SpanKind.CLIENT)
        inject(headers, context=trace.set_span_in_context(span))
        rec.trace_id = format(span.get_span_context().trace_id, "032x")
    rec.send_s = time.perf_counter() - t0
    rec.start_unix_ns = time.time_ns()
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, base_url + spec.endpoint, spec.body(model), headers, rec, t0)
    except _StreamError as e:
        rec.error, rec.error_detail = e.kind, str(e)
    except (TimeoutError, httpx.TimeoutException) as e:
        rec.error, rec.error_detail = (
            "timeout",
            f"no complete response within {timeout_s:g}s ({type(e).__name__})",
        )
    except httpx.HTTPError as e:
        rec.error, rec.error_detail = "connection", f"{type(e).__name__}: {e}"[:200]
    except asyncio.CancelledError:
        rec.error, rec.error_detail = "cancelled", "cut before the stream ended"
        raise
    except Exception as e:
        rec.error, rec.error_detail = "client", f"{type(e).__name__}: {e}"[:200]
    finally:
        if span is not None:
            _finish_span(span, rec, model)
    return rec


def _finish_span(span: trace.Span, rec: RequestRecord, model: str) -> None:
    if span.is_recording():
        attrs: dict[str, Any] = {
            A.GEN_AI_REQUEST_MODEL: model,
            A.GEN_AI_REQUEST_MAX_TOKENS: rec.max_tokens,
            A.GEN_AI_USAGE_OUTPUT_TOKENS: rec.output_tokens,
            A.ITL_COUNT: max(len(rec.token_times_s) - 1, 0),
            "stepscope.client.workload_kind": rec.kind,
            "stepscope.client.request_index": rec.index,
        }
        for key, value in (
            (A.GEN_AI_LATENCY_TTFT, rec.ttft_s),
            (A.GEN_AI_LATENCY_E2E, rec.e2e_s),
            (A.TPOT_MEAN_S, rec.tpot_s),
            (A.GEN_AI_USAGE_INPUT_TOKENS, rec.prompt_tokens),
            ("http.response.status_code", rec.status_code),
        ):
            if value is not None:
                attrs[key] = value
        if rec.finish_reason:
            attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = [rec.finish_reason]
        if rec.error:
            attrs["error.type"] = rec.error
            span.set_status(Status(StatusCode.ERROR, rec.error_detail[:200]))
        span.set_attributes(attrs)
    span.end()
