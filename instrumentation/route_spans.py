"""The fleet router's half: one `route` span (kind SERVER) per request, parent of the replica's work.

span, traceparent = tracer.start(headers.get("traceparent"))      # at arrival; the caller's child
... choose a replica; send the request with `traceparent` (the replica's llm_request hangs on it)
tracer.chosen(span, decision, attempts)                            # policy, candidates, choice
tracer.end(span, error=None)                                       # response complete
"""

from __future__ import annotations

from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from instrumentation import attributes as A
from instrumentation.providers import Telemetry

_PROPAGATOR = TraceContextTextMapPropagator()


class RouteTracer:
    """Builds `route` spans in the router process."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.tracer = telemetry.tracer("stepscope.router")

    def start(self, traceparent: str | None) -> tuple[Span, str]:
        """Open the span (an incoming traceparent is its parent); returns it and the traceparent the
        replica gets."""
        parent = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
        span = self.tracer.start_span(A.SPAN_ROUTE, context=parent, kind=SpanKind.SERVER)
        sc = span.get_span_context()
        return span, f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"

    def chosen(self, span: Span, decision: object, attempts: int) -> None:
        """Record a routing decision (engine.fleet.routing.Decision)."""
        if not span.is_recording():
            return
        names, loads, matches = (
            zip(*decision.candidates, strict=True) if decision.candidates else ((), (), ())
        )
        span.set_attributes(
            {
                A.ROUTE_POLICY: decision.policy,
                A.ROUTE_INSTANCE: decision.replica.instance,
                A.ROUTE_CANDIDATES: list(names),
                A.ROUTE_CANDIDATE_LOADS: list(loads),
                A.ROUTE_CANDIDATE_PREFIX_BLOCKS: list(matches),
                A.ROUTE_PREFIX_BLOCKS: decision.prefix_blocks,
                A.ROUTE_ATTEMPTS: attempts,
            }
        )

    def end(self, span: Span, error: str | None = None) -> None:
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def shutdown(self) -> None:
        self.telemetry.shutdown()


def open_router(config: object) -> RouteTracer:
    """The router's tracer over OTLP exporters (`config`: a TelemetryConfig with role `router`)."""
    return RouteTracer(Telemetry.open(config, process="router"))
