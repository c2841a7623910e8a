"""OpenTelemetry providers for one process: resource, OTLP exporters, drop accounting, bounded shutdown.

Every provider is our own (never the global one), so a library caller's OpenTelemetry setup is left
alone and tests can build as many as they like. Exporting never blocks the caller: spans go to the
SDK's `BatchSpanProcessor` (a bounded queue drained by its own thread); what it cannot queue or the
endpoint refuses is counted here and reported (`Telemetry.dropped_spans`, a log line, a metric).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Tracer

from instrumentation import attributes as A
from instrumentation.config import TelemetryConfig, TelemetryError

DEFAULT_SERVICE_NAME = "stepscope-engine"
_SDK_LOGGERS = (  # per-span / per-batch warnings that would flood stderr when an endpoint is down
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry.exporter.otlp.proto.grpc",
)


def build_resource(config: TelemetryConfig) -> Resource:
    """service.name, stepscope.model, service.instance.id, stepscope.role, host.name;
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over these defaults."""
    defaults = {
        "service.name": DEFAULT_SERVICE_NAME,
        A.RESOURCE_MODEL: config.model,
        A.RESOURCE_INSTANCE: config.instance_id or f"{socket.gethostname()}:{os.getpid()}",
        A.RESOURCE_ROLE: config.role,
        A.RESOURCE_HOST: socket.gethostname(),
    }
    env = dict(OTELResourceDetector().detect().attributes)
    if os.environ.get("OTEL_SERVICE_NAME"):
        env["service.name"] = os.environ["OTEL_SERVICE_NAME"]
    return Resource.create({**defaults, **env})


def _signal_url(base: str, signal: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith(f"/v1/{signal}") else f"{base}/v1/{signal}"


def otlp_exporters(config: TelemetryConfig) -> tuple[SpanExporter, object]:
    """(span exporter, metric exporter) for the configured protocol. With no `--otlp-endpoint` the
    exporters read OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT themselves."""
    if config.protocol == "grpc":
        try:  # optional: pip install 'stepscope[grpc]'
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TelemetryError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the gRPC exporter: pip install 'stepscope[grpc]' "
                "(or use http/protobuf)"
            ) from None
        return OTLPSpanExporter(endpoint=config.endpoint), OTLPMetricExporter(endpoint=config.endpoint)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    traces = _signal_url(config.endpoint, "traces") if config.endpoint else None
    metrics = _signal_url(config.endpoint, "metrics") if config.endpoint else None
    return OTLPSpanExporter(endpoint=traces), OTLPMetricExporter(endpoint=metrics)


class CountingExporter(SpanExporter):
    """Counts the spans of every batch the wrapped exporter failed to deliver."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner, self.failed = inner, 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not kill the SDK's worker thread
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class TelemetryProcessor(SpanProcessor):
    """In front of the batch processor: applies the tail decision on `llm_request` spans (kept only
    when they carry `stepscope.sampling.reason`) and counts spans the full queue turns away."""

    def __init__(self, inner: SpanProcessor) -> None:
        self.inner, self.queue_full, self.unsampled = inner, 0, 0
        batch = getattr(inner, "_batch_processor", None)  # SDK internals, read-only; absent: no count
        self._queue = getattr(batch, "_queue", None)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if span.name == A.SPAN_REQUEST and A.SAMPLING_REASON not in span.attributes:
            self.unsampled += 1
            return
        queue = self._queue
        if queue is not None and queue.maxlen is not None and len(queue) >= queue.maxlen:
            self.queue_full += 1  # the SDK drops the oldest span to make room
        self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Telemetry:
    """A tracer provider and a meter provider for one process, with drop accounting."""

    def __init__(
        self,
        config: TelemetryConfig,
        span_exporter: SpanExporter,
        metric_readers: Sequence[MetricReader] = (),
        process: str = "frontend",
        batch: bool = True,
    ) -> None:
        self.config, self.process = config, process
        self.exporter = CountingExporter(span_exporter)
        inner = BatchSpanProcessor(self.exporter) if batch else _SyncProcessor(self.exporter)
        self.processor = TelemetryProcessor(inner)
        resource = build_resource(config)
        # ALWAYS_ON: the head decision is ours (instrumentation.request_spans), made where the request
        # arrives; links are many on a big batch, so the default limit of 128 is raised.
        self.tracer_provider = TracerProvider(
            sampler=ALWAYS_ON,
            resource=resource,
            shutdown_on_exit=False,
            span_limits=SpanLimits(max_links=4096),
        )
        self.tracer_provider.add_span_processor(self.processor)
        self.meter_provider = MeterProvider(
            metric_readers=list(metric_readers), resource=resource, shutdown_on_exit=False
        )
        self.meter = self.meter_provider.get_meter("stepscope.instrumentation")
        self.extra_dropped: dict[str, Callable[[], int]] = {}  # kind -> count, e.g. the core sink's events
        self._reported: dict[str, int] = {}
        self._last_report = 0.0
        self.meter.create_observable_counter(
            A.METRIC_DROPPED, [self._observe_dropped], unit="{item}", description="telemetry dropped"
        )

    @classmethod
    def open(cls, config: TelemetryConfig, process: str) -> Telemetry:
        """Providers exporting over OTLP as configured. Raises TelemetryError (e.g. gRPC missing)."""
        quiet_sdk_logs()
        span_exporter, metric_exporter = otlp_exporters(config)
        reader = PeriodicExportingMetricReader(metric_exporter)  # honours OTEL_METRIC_EXPORT_INTERVAL
        return cls(config, span_exporter, [reader], process=process)

    def tracer(self, name: str) -> Tracer:
        return self.tracer_provider.get_tracer(name)

    @property
    def dropped_spans(self) -> int:
        return self.processor.queue_full + self.exporter.failed

    def dropped(self) -> dict[str, int]:
        counts = {"spans": self.dropped_spans}
        for kind, count in self.extra_dropped.items():
            counts[kind] = int(count())
        return counts

    def report_drops(self, min_interval_s: float = 10.0) -> None:
        """One log line when the drop counts moved, at most every `min_interval_s`."""
        now = time.monotonic()
        if now - self._last_report < min_interval_s:
            return
        counts = self.dropped()
        if counts != self._reported and any(counts.values()):
            what = ", ".join(f"{n} {kind}" for kind, n in counts.items())
            print(
                f"stepscope telemetry ({self.process}): dropped so far: {what} "
                "(queue full or OTLP endpoint unreachable; serving is unaffected)",
                file=sys.stderr,
                flush=True,
            )
            self._reported, self._last_report = counts, now

    def _observe_dropped(self, options: object) -> list:
        from opentelemetry.metrics import Observation

        self.report_drops()
        return [
            Observation(n, {A.DROPPED_KIND: kind, A.DROPPED_PROCESS: self.process})
            for kind, n in self.dropped().items()
        ]

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush and stop both providers, giving up after `timeout_s` (an unreachable endpoint
        must not hold the process)."""

        def stop() -> None:
            for provider in (self.tracer_provider, self.meter_provider):
                with contextlib.suppress(Exception):  # shutting down must never raise into the host
                    provider.shutdown()

        thread = threading.Thread(target=stop, name="stepscope-telemetry-shutdown", daemon=True)
        thread.start()
        thread.join(timeout_s)
        self.report_drops(min_interval_s=0)


class _SyncProcessor(SpanProcessor):
    """Exports each span as it ends: for tests with an in-memory exporter."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter

    def on_end(self, span: ReadableSpan) -> None:
        self.exporter.export((span,))

    def shutdown(self) -> None:
        self.exporter.shutdown()


class _RateLimit(logging.Filter):
    """Lets each distinct message through once a minute."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = f"{record.name}:{record.msg}", time.monotonic()
        if now - self.seen.get(key, -1e9) < 60:
            return False
        self.seen[key] = now
        return True


def quiet_sdk_logs() -> None:
    """The SDK warns per dropped span and per failed batch; we count those, so rate-limit them."""
    limiter = _RateLimit()
    for name in _SDK_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RateLimit) for f in logger.filters):
            logger.addFilter(limiter)
