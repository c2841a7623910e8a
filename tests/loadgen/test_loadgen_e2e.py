"""End to end against the real `stepscope serve --model tiny`: a short step-load run, the library API with
shifts and client spans, error kinds, and Ctrl-C. Loads are tiny and short: two CPU cores are shared."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from instrumentation.attributes import GEN_AI_LATENCY_TTFT, SPAN_CLIENT_REQUEST
from loadgen.runner import LoadSpec, RunOptions, run_load
from loadgen.workloads import LengthDist, Workload, WorkloadConfig, WorkloadShift
from stepscope.procs import Proc
from tests.support.net import free_port

pytest.importorskip("engine.serve_cli", reason="the server (stepscope serve) has not landed yet")

# the console script, not `python -m stepscope.cli`: run as __main__, that module's UsageError would be a
# second class, distinct from the one loadgen raises
STEPSCOPE = [str(Path(sys.executable).with_name("stepscope"))]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["serve", "--model", "tiny", "--port", str(port), "--num-threads", "1"]
    proc = Proc(args, log, program=STEPSCOPE)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", 120)
        yield url
    finally:
        proc.stop(timeout_s=20)


def _replay_file(path: Path, n: int = 24, max_tokens: int = 12) -> Path:
    rows = [
        {"prompt": f"request {i}: " + "lorem ipsum dolor " * (2 + i % 5), "max_tokens": max_tokens}
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _bench(url: str, out: Path, *args: str) -> list[str]:
    return [*STEPSCOPE, "bench", "--url", url, "--warmup", "1", "--out", str(out), *args]


def test_a_short_step_load_run_writes_results_and_plots(server, tmp_path):
    out = tmp_path / "res" / "results.json"
    trace = _replay_file(tmp_path / "w.jsonl")
    args = ["--workload", str(trace), "--step-load", "1,2", "--duration", "2s"]
    args += ["--slo-ttft", "2s", "--slo-tpot", "200ms", "--cost-per-hour", "2.0"]
    proc = subprocess.run(_bench(server, out, *args), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert [s["load"] for s in r["steps"]] == [1, 2]
    assert all(s["completed"] > 0 for s in r["steps"])
    assert all(s["errors"] == {} for s in r["steps"])
    s = r["steps"][0]
    assert s["ttft_s"]["p99"] > 0 and s["tpot_s"]["p99"] > 0 and s["e2e_s"]["p50"] > 0
    assert 0 < s["slo_attainment"] <= 1 and s["fluidity_index"] is not None
    assert s["mean_output_tokens"] == 12  # ignore_eos: outputs follow the workload
    assert {"knee", "recommended_load", "cost_per_1k_requests"} <= r.keys()
    assert r["recommended_load"] is None or r["cost_per_1k_requests"] > 0
    for p in r["plots"]:
        assert Path(p).read_bytes()[:4] == b"\x89PNG"
    assert len(r["plots"]) == 2
    lines = (out.parent / "results_requests.jsonl").read_text().splitlines()
    assert len(lines) == sum(s["num_requests"] for s in r["steps"])
    requests = [json.loads(line) for line in lines]
    for i, step in enumerate(r["steps"]):  # goodput and attainment, recounted from the request records
        mine = [q for q in requests if q["step"] == i]
        good = [q for q in mine if q["ok"] and q["ttft_s"] <= 2.0 and (q["tpot_s"] or 0) <= 0.2]
        in_window = [q for q in good if q["end_s"] <= step["duration_s"]]
        assert in_window, f"step {i}: no request met the SLO inside the window"
        assert step["goodput_rps"] == pytest.approx(len(in_window) / step["duration_s"])
        assert 0 < step["goodput_rps"] <= step["request_throughput_rps"]
        assert step["slo_attainment"] == pytest.approx(len(good) / len(mine))
    assert "TTFT p50/p99" in proc.stdout and "knee:" in proc.stdout


def test_the_library_runs_a_shifted_workload_with_client_spans(server):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = WorkloadConfig(
        seed=1,
        system_prompt_tokens=256,
        shared_user_prompt=LengthDist(16, 0.2, 8, 32),
        shared_output=LengthDist(6, 0.2, 4, 8),
        shifts=(WorkloadShift(start_s=0.0, prompt_len_factor=2.0),),
    )
    wl = Workload.load("shared-prefix", cfg)
    opts = RunOptions(model="tiny", tracer=provider.get_tracer("test"))
    sent: list[str] = []

    async def record_traceparent(request: httpx.Request) -> None:
        sent.append(request.headers.get("traceparent", ""))

    async def go():
        async with httpx.AsyncClient(timeout=60.0, event_hooks={"request": [record_traceparent]}) as client:
            return await run_load(server, wl, LoadSpec(concurrency=2, num_requests=6), opts, client=client)

    res = asyncio.run(go())
    assert [r.error for r in res.records] == [None] * 6
    assert all(r.ok and r.output_tokens >= 4 for r in res.records)
    # the shared system prompt hits the server's prefix cache once it has been seen
    assert max(r.cached_tokens or 0 for r in res.records[2:]) >= 128
    spans = exporter.get_finished_spans()
    assert len(spans) == 6
    assert all(s.name == SPAN_CLIENT_REQUEST and s.kind == SpanKind.CLIENT for s in spans)
    assert {format(s.context.trace_id, "032x") for s in spans} == {r.trace_id for r in res.records}
    assert all(s.attributes[GEN_AI_LATENCY_TTFT] > 0 for s in spans)
    # each request carried its span's context, so the server's request span joins the client's trace
    span_ids = {(format(s.context.trace_id, "032x"), format(s.context.span_id, "016x")) for s in spans}
    assert {tuple(tp.split("-")[1:3]) for tp in sent} == span_ids


def test_server_refusals_and_timeouts_are_counted_by_kind(server, tmp_path):
    too_long = tmp_path / "long.jsonl"
    too_long.write_text(json.dumps({"prompt": "x" * 5000, "max_tokens": 4}) + "\n")
    res = asyncio.run(
        run_load(
            server, Workload.load(str(too_long)), LoadSpec(concurrency=1, num_requests=2), RunOptions("tiny")
        )
    )
    assert [r.error for r in res.records] == ["http_4xx", "http_4xx"]
    assert res.records[0].status_code == 400
    quick = Workload.load(str(_replay_file(tmp_path / "q.jsonl", n=2, max_tokens=200)))
    res = asyncio.run(
        run_load(server, quick, LoadSpec(concurrency=1, num_requests=2), RunOptions("tiny", timeout_s=0.05))
    )
    assert [r.error for r in res.records] == ["timeout", "timeout"]


def test_ctrl_c_writes_the_partial_results(server, tmp_path):
    out = tmp_path / "results.json"
    trace = _replay_file(tmp_path / "w.jsonl", max_tokens=64)
    args = ["--workload", str(trace), "--step-load", "1,2", "--duration", "60s", "--slo-ttft", "2s"]
    proc = subprocess.Popen(
        _bench(server, out, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        line = proc.stderr.readline()  # "step 1/2 concurrency=1: started (60s)": the handler is in place
        assert "started" in line, line
        time.sleep(1.0)  # let a request or two finish
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    r = json.loads(out.read_text())
    assert r["interrupted"] is True and len(r["steps"]) == 1 and r["steps"][0]["interrupted"]
    assert "cancelled" not in r["steps"][0]["errors"]  # cut by the operator, not failed by the server
    assert "interrupted: partial results" in stdout


def test_a_model_the_server_does_not_serve_is_a_usage_error(server, tmp_path):
    proc = subprocess.run(
        _bench(server, tmp_path / "r.json", "--model", "gpt-9", "--num-requests", "1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "not served" in proc.stderr
