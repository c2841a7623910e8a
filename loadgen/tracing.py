"""Client spans over OTLP/HTTP, only when an endpoint is configured (otherwise no tracer: no cost at all).

The tracer comes from a provider of our own (never the global one), so a library caller's tracing setup
is left alone; `shutdown()` flushes what is buffered.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from opentelemetry.trace import Tracer

SERVICE_NAME = "stepscope-bench"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for a base endpoint (as OTEL_EXPORTER_OTLP_ENDPOINT is defined)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def configured_endpoint(cli_endpoint: str | None) -> str | None:
    """The traces URL from `--otlp-endpoint`, else from the standard environment variables, else None."""
    if cli_endpoint:
        return traces_url(cli_endpoint)
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return traces_url(os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return None


def make_tracer(traces_endpoint: str | None) -> tuple[Tracer | None, Callable[[], None]]:
    """(tracer, shutdown) exporting to `traces_endpoint`; (None, no-op) when it is None."""
    if not traces_endpoint:
        return None, lambda: None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_endpoint)))
    return provider.get_tracer("stepscope.loadgen"), provider.shutdown
