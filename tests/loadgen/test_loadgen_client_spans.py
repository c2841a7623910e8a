"""The client span of a request, read from the real SDK's in-memory exporter; failures recorded by kind."""

import asyncio
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from instrumentation.attributes import GEN_AI_REQUEST_MAX_TOKENS, GEN_AI_REQUEST_MODEL, SPAN_CLIENT_REQUEST
from loadgen.client import RequestRecord, send_request
from loadgen.runner import LoadSpec, RunOptions, make_client, run_load
from loadgen.tracing import configured_endpoint, make_tracer, traces_url
from loadgen.workloads import Workload
from tests.support.net import free_port


def test_a_refused_request_is_a_connection_error_on_an_error_client_span():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spec = Workload.load("chat").request(0)
    rec = RequestRecord(0, spec.kind, spec.max_tokens, spec.prompt_tokens_est, 0.0)

    async def go():
        async with make_client(5.0) as client:
            url = f"http://127.0.0.1:{free_port()}"
            t0 = time.perf_counter()
            tracer = provider.get_tracer("t")
            return await send_request(
                client, url, spec, rec, model="tiny", t0=t0, timeout_s=5.0, tracer=tracer
            )

    out = asyncio.run(go())
    assert out is rec and rec.error == "connection" and not rec.ok
    (span,) = exporter.get_finished_spans()
    assert span.name == SPAN_CLIENT_REQUEST and span.kind == SpanKind.CLIENT
    assert span.attributes[GEN_AI_REQUEST_MODEL] == "tiny"
    assert span.attributes[GEN_AI_REQUEST_MAX_TOKENS] == spec.max_tokens
    assert span.attributes["error.type"] == "connection"
    assert span.status.status_code == StatusCode.ERROR
    assert rec.trace_id == format(span.context.trace_id, "032x")


def test_a_run_against_nothing_records_every_request_as_failed_and_never_raises():
    wl = Workload.load("chat")
    load = LoadSpec(concurrency=2, num_requests=5)
    res = asyncio.run(run_load(f"http://127.0.0.1:{free_port()}", wl, load, RunOptions(model="m")))
    assert len(res.records) == 5
    assert {r.error for r in res.records} == {"connection"}
    assert [r.index for r in res.records] == list(range(5))


def test_no_endpoint_means_no_tracer(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert configured_endpoint(None) is None
    tracer, shutdown = make_tracer(None)
    assert tracer is None
    shutdown()


def test_the_endpoint_comes_from_the_flag_or_the_standard_variable(monkeypatch):
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318")
    assert configured_endpoint(None) == "http://env:4318/v1/traces"
    assert configured_endpoint("http://flag:4318") == "http://flag:4318/v1/traces"
