"""`stepscope serve --replicas 3` on the tiny model: real replica processes behind the router, traced over
real OTLP/HTTP, called by the OpenTelemetry SDK's propagator as a client would."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from instrumentation import attributes as A
from stepscope.otlp_receiver import OtlpReceiver
from tests.instrumentation.test_serve_otlp import Serve
from tests.support.net import wait_for

TOKEN = "fleet-admin"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
IDS = ["r0", "r1", "r2"]
LONG = "a shared system prompt that runs for several blocks of tokens, " * 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    receiver = OtlpReceiver()
    env = {"OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_METRIC_EXPORT_INTERVAL": "60000", "STEPSCOPE_NVML": "0"}
    log = tmp_path_factory.mktemp("fleet") / "serve.log"
    serve = Serve(log, "--replicas", "3", "--instance-id", ",".join(IDS), "--admin-token", TOKEN,
                  "--otlp-endpoint", receiver.url, env=env)  # fmt: skip
    yield serve, receiver
    assert serve.stop() == 0
    receiver.close()


def test_one_trace_spans_the_caller_the_router_and_the_replica(fleet):
    serve, receiver = fleet
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("caller").start_as_current_span("caller") as caller:
        headers: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(headers, context=set_span_in_context(caller))
        serve.complete("one trace, three processes", headers)
    ctx = exporter.get_finished_spans()[0].context
    trace_id, caller_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
    for name in (A.SPAN_REQUEST, A.SPAN_ROUTE):  # the route span ends once the response is relayed
        wait_for(lambda n=name: any(s["trace_id"] == trace_id for s in receiver.named(n)))
    (route,) = [s for s in receiver.named(A.SPAN_ROUTE) if s["trace_id"] == trace_id]
    (req,) = [s for s in receiver.named(A.SPAN_REQUEST) if s["trace_id"] == trace_id]
    assert route["parent"] == caller_id and req["parent"] == route["span_id"]
    assert route["resource"][A.RESOURCE_ROLE] == "router"
    chosen = route["attrs"][A.ROUTE_INSTANCE]
    assert chosen in IDS and req["resource"][A.RESOURCE_INSTANCE] == chosen
    assert req["resource"][A.RESOURCE_HOST] and route["attrs"][A.ROUTE_POLICY] == "prefix_aware"
    assert sorted(route["attrs"][A.ROUTE_CANDIDATES]) == IDS


def test_a_repeated_prefix_goes_back_to_the_replica_that_cached_it(fleet):
    serve, receiver = fleet
    outs = [serve.complete(LONG + tail) for tail in ("first question", "second question")]
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 16
    wait_for(lambda: sum(A.ROUTE_INSTANCE in s["attrs"] for s in receiver.named(A.SPAN_ROUTE)) >= 3)
    last = max(receiver.named(A.SPAN_ROUTE), key=lambda s: s["start"])
    assert max(last["attrs"][A.ROUTE_CANDIDATE_PREFIX_BLOCKS]) >= 3


def test_admin_targets_one_instance_and_an_unknown_one_changes_nothing(fleet):
    serve, _ = fleet
    bad = httpx.post(
        serve.url + "/admin/faults", json={"instance": "r9", "scheduler_stall_ms": 5}, headers=ADMIN
    )
    assert bad.status_code == 400 and "r9" in bad.json()["error"]["message"]
    bad = httpx.post(serve.url + "/admin/limits", json={"instance": "r9", "max_num_seqs": 4}, headers=ADMIN)
    assert bad.status_code == 400
    faults = httpx.get(serve.url + "/admin/faults", headers=ADMIN).json()
    assert all(f["scheduler_stall_ms"] == 0 for f in faults["instances"].values())
    ok = httpx.post(serve.url + "/admin/limits", json={"instance": "r1", "max_num_seqs": 4}, headers=ADMIN)
    assert ok.status_code == 200
    limits = httpx.get(serve.url + "/admin/limits", headers=ADMIN).json()
    assert [limits[i]["max_num_seqs"] for i in IDS] == [32, 4, 32]


def test_a_client_that_hangs_up_mid_stream_frees_the_replica(fleet):
    serve, receiver = fleet
    replicas = httpx.get(serve.url + "/health").json()["replicas"]

    def running() -> int:
        total = 0
        for r in replicas:
            for line in httpx.get(r["url"] + "/metrics").text.splitlines():
                if line.startswith("vllm:num_requests_running"):
                    total += int(float(line.rsplit(" ", 1)[1]))
        return total

    body = {"prompt": "a long answer, cut short", "max_tokens": 1900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        wait_for(lambda: running() == 1, timeout_s=5)  # generating, the client still there
        r.close()  # the client hangs up after its first token
    # the router closes its connection to the replica, which aborts the request; the router's count drops
    wait_for(lambda: running() == 0, timeout_s=10)
    loads = {r["instance"]: r["load"] for r in httpx.get(serve.url + "/health").json()["replicas"]}
    assert set(loads.values()) == {0}
    # it ended as aborted, not by running to its length
    wait_for(lambda: _long_request(receiver) is not None)
    assert _long_request(receiver)["attrs"][A.GEN_AI_RESPONSE_FINISH_REASONS] == ("abort",)


def _long_request(receiver: OtlpReceiver) -> dict | None:
    """The llm_request span of the one request in this module that asked for 1,900 tokens."""
    spans = [s for s in receiver.named(A.SPAN_REQUEST) if s["attrs"].get(A.GEN_AI_REQUEST_MAX_TOKENS) == 1900]
    return spans[-1] if spans else None


def test_a_killed_replica_leaves_the_others_serving(fleet):
    serve, _ = fleet
    pid = next(r["pid"] for r in httpx.get(serve.url + "/health").json()["replicas"] if r["instance"] == "r2")
    os.kill(pid, signal.SIGKILL)
    outs = [serve.complete(f"after the loss {i}") for i in range(6)]
    assert all(o["usage"]["completion_tokens"] == 8 for o in outs)
    states = {r["instance"]: r["state"] for r in httpx.get(serve.url + "/health").json()["replicas"]}
    assert states == {"r0": "healthy", "r1": "healthy", "r2": "dead"}
