"""`stepscope serve --otlp-endpoint` end to end: real processes exporting over real OTLP/HTTP
(protobuf) to a receiver in this test, the caller's traceparent continued across the RPC."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from instrumentation import attributes as A
from stepscope.otlp_receiver import OtlpReceiver
from stepscope.procs import Proc
from tests.support.net import free_port, wait_for

STEPSCOPE = str(Path(sys.executable).with_name("stepscope"))
CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PROMPTS = ["the quick brown fox", "traced request", "p " * 30, "hello hello hello"]


class Serve(Proc):
    """`stepscope serve --model tiny` in its own process group, stopped with SIGTERM."""

    def __init__(self, log: Path, *options: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["serve", "--model", "tiny", "--port", str(self.port), "--num-threads", "1", *options]
        base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        super().__init__(args, log, {**base, **(env or {})}, program=[STEPSCOPE])
        self.wait_http(self.url + "/health", 120)

    def complete(self, prompt: str, headers: dict | None = None, **body) -> dict:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
        r = httpx.post(self.url + "/v1/completions", json=body, headers=headers or {}, timeout=60)
        r.raise_for_status()
        return r.json()


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A traced server, after serving PROMPTS (the first with the caller's traceparent) and a stream."""
    receiver = OtlpReceiver()
    env = {
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_RESOURCE_ATTRIBUTES": "stepscope.role=decode,deployment.environment=test",
        "STEPSCOPE_NVML": "0",  # host CPU counters on every host, with an NVIDIA driver or without
    }
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    serve = Serve(log, "--otlp-endpoint", receiver.url, env=env)
    texts = [serve.complete(PROMPTS[0], {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})]
    texts += [serve.complete(p) for p in PROMPTS[1:]]
    with httpx.stream("POST", serve.url + "/v1/completions", json={"prompt": "stream", "stream": True}) as r:
        r.read()
    wait_for(lambda: len(receiver.named(A.SPAN_REQUEST)) >= 5 and len(receiver.named(A.SPAN_DECODE)) >= 5, 30)
    wait_for(lambda: A.METRIC_TPOT in receiver.metrics and A.METRIC_RUNNING in receiver.metrics, 30)
    yield receiver, [t["choices"][0]["text"] for t in texts]
    assert serve.stop() == 0
    receiver.close()


def test_the_callers_traceparent_is_continued_by_llm_request(traced):
    receiver, _ = traced
    mine = [s for s in receiver.named(A.SPAN_REQUEST) if s["trace_id"] == CALLER_TRACE]
    assert len(mine) == 1 and mine[0]["parent"] == CALLER_SPAN
    assert mine[0]["kind"] == 2  # SPAN_KIND_SERVER
    others = [s for s in receiver.named(A.SPAN_REQUEST) if s["trace_id"] != CALLER_TRACE]
    assert len(others) == 4 and all(s["parent"] == "" for s in others)


def test_phase_spans_from_the_core_process_are_children_of_llm_request(traced):
    receiver, _ = traced
    for req in receiver.named(A.SPAN_REQUEST):
        kids = [s for s in receiver.spans if s["parent"] == req["span_id"]]
        assert {A.SPAN_QUEUE, A.SPAN_PREFILL, A.SPAN_DECODE} <= {k["name"] for k in kids}
        assert all(k["trace_id"] == req["trace_id"] for k in kids)
        assert all(req["start"] <= k["start"] <= k["end"] <= req["end"] for k in kids)
        a = req["attrs"]
        assert 0 < a[A.GEN_AI_LATENCY_TTFT] <= a[A.GEN_AI_LATENCY_E2E] <= (req["end"] - req["start"]) / 1e9
        assert abs(a[A.GEN_AI_LATENCY_QUEUE] + a[A.GEN_AI_LATENCY_PREFILL] - a[A.GEN_AI_LATENCY_TTFT]) < 1e-3
        assert req["events"] == [A.EVENT_FIRST_TOKEN]


def test_engine_steps_link_to_the_requests_they_served(traced):
    receiver, _ = traced
    req_ids = {s["span_id"] for s in receiver.named(A.SPAN_REQUEST)}
    links = [link for s in receiver.named(A.SPAN_STEP) for link in s["links"]]
    assert req_ids <= {span_id for span_id, _ in links}
    assert all(attrs[A.LINK_TOKENS] >= 1 for _, attrs in links)
    step = receiver.named(A.SPAN_STEP)[0]
    assert {A.STEP_BATCH_SIZE, A.STEP_KV_BLOCKS_TOTAL, A.STEP_WEIGHT_DTYPE} <= set(step["attrs"])
    host = [s for s in receiver.named(A.SPAN_STEP) if A.HOST_CPU_UTILIZATION in s["attrs"]]
    assert host and 0 <= host[0]["attrs"][A.HOST_CPU_UTILIZATION] <= 1  # STEPSCOPE_NVML=0: the host CPU


def test_resource_names_the_model_instance_and_role_with_otel_variables_merged(traced):
    receiver, _ = traced
    for span in receiver.spans:  # both processes
        r = span["resource"]
        assert r["service.name"] == "stepscope-engine" and r[A.RESOURCE_MODEL] == "tiny"
        assert r[A.RESOURCE_ROLE] == "decode" and r["deployment.environment"] == "test"
        assert r[A.RESOURCE_INSTANCE].endswith(":" + r[A.RESOURCE_INSTANCE].rsplit(":", 1)[1])
    assert len({s["resource"][A.RESOURCE_INSTANCE] for s in receiver.spans}) == 1


def test_genai_metrics_arrive_with_semconv_units_and_buckets(traced):
    receiver, _ = traced
    m = receiver.metrics
    assert m[A.METRIC_TTFT] == {"unit": "s", "bounds": A.TTFT_BUCKETS_S}
    assert m[A.METRIC_TPOT] == {"unit": "s", "bounds": A.TPOT_BUCKETS_S}
    assert m[A.METRIC_REQUEST_DURATION] == {"unit": "s", "bounds": A.DURATION_BUCKETS_S}
    for name in (A.METRIC_QUEUE_TIME, A.METRIC_TOKENS, A.METRIC_WAITING, A.METRIC_KV_USAGE,
                 A.METRIC_PREFIX_HIT_RATIO, A.METRIC_PREEMPTIONS, A.METRIC_DROPPED):  # fmt: skip
        assert name in m, name


def test_tracing_on_does_not_change_greedy_outputs(traced, tmp_path):
    _, traced_texts = traced
    plain = Serve(tmp_path / "plain.log")
    try:
        assert [plain.complete(p)["choices"][0]["text"] for p in PROMPTS] == traced_texts
    finally:
        assert plain.stop() == 0
    assert "NVML" not in (tmp_path / "plain.log").read_text()  # no sink: nothing of telemetry ran


def test_an_unreachable_endpoint_never_stops_serving(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
    serve = Serve(tmp_path / "dead.log", "--otlp-endpoint", dead, env=env)
    try:
        outs = [serve.complete(p, max_tokens=16) for p in PROMPTS * 3]
        assert all(o["usage"]["completion_tokens"] == 16 for o in outs)
        assert httpx.get(serve.url + "/health").status_code == 200
    finally:
        assert serve.stop() == 0  # and shutdown stays bounded, the flush giving up
