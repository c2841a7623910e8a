"""The front end's half: one `llm_request` span (kind SERVER) per request, and the GenAI metrics.

    trace = tracer.start(req_id, arrival_ns, headers.get("traceparent"), ...)  # at arrival
    EngineRequest(..., trace_context=trace.traceparent)                         # to the core
    trace.observe(output)                                                       # each RequestOutput
    tracer.finish(trace, finish_reason=..., error=None)                         # response complete

The span starts at the request's arrival (explicit start time) and ends when the response is
complete, so its duration covers gen_ai.latency.e2e. Latencies come from the core's timings
(CLOCK_MONOTONIC, the same clock in both processes): queue = first_scheduled - arrival, prefill =
first_token - first_scheduled, TTFT = queue + prefill, decode = last_token - first_token,
e2e = finished - arrival. Phase children (queue, prefill, decode) are built in the core process.

Sampling: the span is always recorded. The head decision (OTEL_TRACES_SAMPLER, default
parentbased_always_on) is taken at arrival and travels to the core in the traceparent's flags; at
the end, a request that was not head-sampled is still kept when it was slow or failed
(`stepscope.sampling.reason`); `TelemetryProcessor` drops `llm_request` spans without a reason.
"""

from __future__ import annotations

import hashlib
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Sampler, _get_from_env_or_default
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from instrumentation import attributes as A
from instrumentation.providers import Telemetry

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(slots=True)
class RequestTrace:
    """One request's span and what the front end saw of it, on the core's clock."""

    span: trace.Span
    traceparent: str  # the span's context for the core; flags carry the head decision
    head_sampled: bool
    arrival_ns: int
    attrs: dict[str, object]  # metric attributes (operation, model)
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    finished_ns: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    itl_max_ns: int = 0
    itl_count: int = 0
    finished: bool = False
    kv_transfer_ns: int = 0  # disaggregated: prefill's first token -> decode worker's commit (docs/disagg.md)
    handoff_ns: int = 0  # the front end handed the request to the core's queue (0: not yet)
    loop_lag_s: float | None = None  # the front end's worst event-loop lag while the request was open

    def observe(self, out: object) -> None:
        """Take what a `RequestOutput` says; the inter-token gaps are those of the core's clock."""
        t = out.timings
        if out.new_token_ids and self.last_token_ns and t.last_token_ns > self.last_token_ns:
            self.itl_max_ns = max(self.itl_max_ns, t.last_token_ns - self.last_token_ns)
            self.itl_count += len(out.new_token_ids)
        self.first_scheduled_ns = t.first_scheduled_ns
        self.first_token_ns = t.first_token_ns
        self.last_token_ns = t.last_token_ns
        self.finished_ns = t.finished_ns
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens += len(out.new_token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        self.num_preemptions = out.num_preemptions


class RequestTracer:
    """Builds `llm_request` spans and records the request-level metrics (in the front end)."""

    def __init__(self, telemetry: Telemetry, head_sampler: Sampler | None = None) -> None:
        self.telemetry = telemetry
        self.config = telemetry.config
        self.tracer = telemetry.tracer("stepscope.frontend")
        self.head_sampler = head_sampler or _get_from_env_or_default()
        meter = telemetry.meter
        self.ttft = meter.create_histogram(
            A.METRIC_TTFT, "s", "time to first token", explicit_bucket_boundaries_advisory=A.TTFT_BUCKETS_S
        )
        self.tpot = meter.create_histogram(
            A.METRIC_TPOT, "s", "time per output token after the first",
            explicit_bucket_boundaries_advisory=A.TPOT_BUCKETS_S,
        )  # fmt: skip
        self.duration = meter.create_histogram(
            A.METRIC_REQUEST_DURATION, "s", "request duration (to the last token)",
            explicit_bucket_boundaries_advisory=A.DURATION_BUCKETS_S,
        )  # fmt: skip
        self.queue = meter.create_histogram(
            A.METRIC_QUEUE_TIME, "s", "time in the waiting queue",
            explicit_bucket_boundaries_advisory=A.TTFT_BUCKETS_S,
        )  # fmt: skip
        self._failed = False
        self.head_ratio = head_ratio(self.head_sampler)
        self.tokens = meter.create_counter(A.METRIC_TOKENS, "{token}", "tokens by gen_ai.token.type")

    def start(
        self,
        req_id: str,
        arrival_ns: int,
        traceparent: str | None,
        *,
        model: str,
        operation: str,
        max_tokens: int,
        temperature: float,
        top_p: float,
        prompt_ids: list[int] | None = None,
        block_size: int = 0,
        cache_salt: str = "",
    ) -> RequestTrace:
        """Open the request's span at its arrival; an incoming `traceparent` becomes its parent.
        With `prompt_ids` and `block_size`, the span carries the prompt's prefix-cache key."""
        parent = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
        attrs = {
            A.GEN_AI_OPERATION_NAME: operation,
            A.GEN_AI_REQUEST_MODEL: model,
            A.GEN_AI_REQUEST_ID: req_id,
            A.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
            A.GEN_AI_REQUEST_TEMPERATURE: float(temperature),
            A.GEN_AI_REQUEST_TOP_P: float(top_p),
            A.PREFIX_KEY: prefix_key(prompt_ids or [], block_size, cache_salt),
        }
        span = self.tracer.start_span(
            A.SPAN_REQUEST,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attrs,
            start_time=self.config.to_epoch_ns(arrival_ns),
        )
        sc = span.get_span_context()
        head = self.head_sampler.should_sample(parent, sc.trace_id, A.SPAN_REQUEST, SpanKind.SERVER)
        sampled = head.decision.is_sampled()
        traceparent_out = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{'01' if sampled else '00'}"
        metric_attrs = {A.GEN_AI_OPERATION_NAME: operation, A.GEN_AI_REQUEST_MODEL: model}
        return RequestTrace(span, traceparent_out, sampled, arrival_ns, metric_attrs)

    def finish(self, rt: RequestTrace, finish_reason: str | None, error: str | None = None) -> None:
        """Set the latencies and counts, decide whether to keep it, end the span, record metrics.
        Idempotent; never raises into the caller."""
        if rt.finished:
            return
        rt.finished = True
        try:
            self._finish(rt, finish_reason, error)
        except Exception as e:  # tracing must never break serving: say so once, carry on
            if not self._failed:
                self._failed = True
                print(
                    f"stepscope telemetry: a request span failed ({e!r}); serving continues", file=sys.stderr
                )

    def _finish(self, rt: RequestTrace, finish_reason: str | None, error: str | None) -> None:
        now_ns = time.monotonic_ns()
        finished_ns = rt.finished_ns or now_ns
        if error is None and finish_reason in (None, "abort"):
            error = "aborted before completion"
        lat = _latencies(rt, finished_ns)
        span = rt.span
        attrs: dict[str, object] = {
            A.GEN_AI_LATENCY_E2E: lat["e2e"],
            A.GEN_AI_USAGE_INPUT_TOKENS: rt.num_prompt_tokens,
            A.GEN_AI_USAGE_OUTPUT_TOKENS: rt.num_output_tokens,
            A.GEN_AI_USAGE_PROMPT_TOKENS: rt.num_prompt_tokens,
            A.GEN_AI_USAGE_COMPLETION_TOKENS: rt.num_output_tokens,
            A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: rt.num_cached_tokens,
            A.GEN_AI_RESPONSE_FINISH_REASONS: (finish_reason or "abort",),
            A.PREEMPTIONS: rt.num_preemptions,
            A.ITL_COUNT: rt.itl_count,
        }
        if "kv_transfer" in lat:
            attrs[A.KV_TRANSFER_S] = lat["kv_transfer"]
        for key, name in (
            (A.GEN_AI_LATENCY_QUEUE, "queue"),
            (A.GEN_AI_LATENCY_PREFILL, "prefill"),
            (A.GEN_AI_LATENCY_TTFT, "ttft"),
            (A.GEN_AI_LATENCY_DECODE, "decode"),
        ):
            if name in lat:
                attrs[key] = lat[name]
        if rt.itl_count:
            attrs[A.TPOT_MEAN_S] = (rt.last_token_ns - rt.first_token_ns) / 1e9 / rt.itl_count
            attrs[A.TPOT_MAX_S] = rt.itl_max_ns / 1e9
        if rt.handoff_ns:
            attrs[A.FRONTEND_S] = max(rt.handoff_ns - rt.arrival_ns, 0) / 1e9
        if rt.loop_lag_s is not None:
            attrs[A.FRONTEND_LOOP_LAG_S] = rt.loop_lag_s
        reason = "head" if rt.head_sampled else None
        # Slow and failed requests are all kept; the rest only when head-sampled: each kept fast one
        # stands for 1 / ratio requests, each slow or failed one for itself.
        kept_anyway = error is not None or lat["e2e"] > self.config.slow_request_s
        attrs[A.SAMPLING_WEIGHT] = 1.0 if kept_anyway else 1.0 / self.head_ratio
        if error is not None:
            attrs[A.ERROR_TYPE] = "abort" if finish_reason in (None, "abort") else "error"
            span.set_status(Status(StatusCode.ERROR, error))
            reason = reason or "error"
        elif lat["e2e"] > self.config.slow_request_s:
            reason = reason or "slow"
        if reason:
            attrs[A.SAMPLING_REASON] = reason
        span.set_attributes(attrs)
        if rt.first_token_ns:
            span.add_event(A.EVENT_FIRST_TOKEN, timestamp=self.config.to_epoch_ns(rt.first_token_ns))
        span.end(end_time=self.config.to_epoch_ns(max(now_ns, finished_ns)))
        self._record_metrics(rt, lat, attrs, error)

    def _record_metrics(self, rt: RequestTrace, lat: dict, attrs: dict, error: str | None) -> None:
        m = rt.attrs
        self.duration.record(lat["e2e"], {**m, A.ERROR_TYPE: attrs[A.ERROR_TYPE]} if error else m)
        self.tokens.add(rt.num_prompt_tokens, {**m, A.GEN_AI_TOKEN_TYPE: "input"})
        self.tokens.add(rt.num_output_tokens, {**m, A.GEN_AI_TOKEN_TYPE: "output"})
        self.tokens.add(rt.num_cached_tokens, {**m, A.GEN_AI_TOKEN_TYPE: "cached"})
        if "queue" in lat:
            self.queue.record(lat["queue"], m)
        if error is None and "ttft" in lat:
            self.ttft.record(lat["ttft"], m)
        if error is None and A.TPOT_MEAN_S in attrs:
            self.tpot.record(attrs[A.TPOT_MEAN_S], m)

    def watch_engine(self, stats: Callable[[], object]) -> None:
        """Engine gauges from the core's stats record, which the front end receives every step."""
        from opentelemetry.metrics import Observation

        def gauge(read: Callable[[object], float]) -> Callable[[object], list[Observation]]:
            def observe(options: object) -> list[Observation]:
                return [Observation(read(stats()), {A.GEN_AI_REQUEST_MODEL: self.config.model})]

            return observe

        meter = self.telemetry.meter
        meter.create_observable_gauge(A.METRIC_RUNNING, [gauge(lambda s: s.running)], "{request}")
        meter.create_observable_gauge(A.METRIC_WAITING, [gauge(lambda s: s.waiting)], "{request}")
        meter.create_observable_gauge(A.METRIC_KV_USAGE, [gauge(lambda s: s.kv_usage)], "1")
        meter.create_observable_gauge(A.METRIC_PREFIX_HIT_RATIO, [gauge(_hit_ratio)], "1")
        meter.create_observable_counter(
            A.METRIC_PREEMPTIONS, [gauge(lambda s: s.preemptions_total)], "{preemption}"
        )
        self.telemetry.extra_dropped["events"] = lambda: stats().events_dropped


def head_ratio(sampler: Sampler) -> float:
    """The share of root requests the head sampler keeps (1.0 when it is not a ratio sampler)."""
    for candidate in (sampler, getattr(sampler, "_root", None)):
        rate = getattr(candidate, "rate", None)
        if isinstance(rate, int | float) and 0 < rate <= 1:
            return float(rate)
    return 1.0


def prefix_key(prompt_ids: list[int], block_size: int, cache_salt: str = "") -> str:
    """The hex hash the core gives the prompt's first full block ("" if none): the same function as
    engine.block_manager.hash_block with no parent, restated so the front end never imports torch
    (a test holds the two equal)."""
    if block_size < 1 or len(prompt_ids) < block_size:
        return ""
    h = hashlib.blake2b(b"", digest_size=16)
    h.update(array("q", prompt_ids[:block_size]).tobytes())
    if cache_salt:
        h.update(b"#salt:" + cache_salt.encode())
    return h.hexdigest()


def _hit_ratio(stats: object) -> float:
    return stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0


def _latencies(rt: RequestTrace, finished_ns: int) -> dict[str, float]:
    """Seconds. Phases the request never reached are left out (not zero)."""
    lat = {"e2e": (finished_ns - rt.arrival_ns) / 1e9}
    if rt.first_scheduled_ns:
        lat["queue"] = (rt.first_scheduled_ns - rt.arrival_ns) / 1e9
    if rt.first_scheduled_ns and rt.first_token_ns:
        # Disaggregated, the first token reaches the client when the decode worker has the KV: TTFT =
        # queue + prefill + kv_transfer, the transfer being the part not hidden behind the prefill.
        kv_ns = min(rt.kv_transfer_ns, rt.first_token_ns - rt.first_scheduled_ns)
        if rt.kv_transfer_ns:
            lat["kv_transfer"] = kv_ns / 1e9
        lat["prefill"] = (rt.first_token_ns - rt.first_scheduled_ns - kv_ns) / 1e9
        lat["ttft"] = (rt.first_token_ns - rt.arrival_ns) / 1e9
        lat["decode"] = (rt.last_token_ns - rt.first_token_ns) / 1e9
    return lat


def open_frontend(config: object) -> RequestTracer:
    """The front end's tracer over OTLP exporters (`config`: a TelemetryConfig). Raises
    TelemetryError when the configuration cannot work (e.g. gRPC asked for but not installed)."""
    return RequestTracer(Telemetry.open(config, process="frontend"))
