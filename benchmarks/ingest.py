"""Ingest throughput: OTLP/HTTP protobuf into a running collector (chDB) vs the same rows inserted directly.

    python benchmarks/ingest.py [--requests 12500] [--senders 4] [--batch 512]

Spans are made by the OpenTelemetry SDK the way stepscope's instrumentation makes them (per request: an
`llm_request` SERVER span with the GenAI latency attributes and a first_token event, queue/prefill/decode
children, and four `engine.step` spans with ~20 attributes and a link each), encoded by the OTLP exporter's
own encoder in batches of 512 (the BatchSpanProcessor's default), and POSTed by `--senders` concurrent
clients (several engine processes) to `stepscope collector` started as a real process. `spans_per_s` is
spans per second of wall time from the first POST until `count()` in otel_traces shows every one of them
(acknowledged and queryable, not just acknowledged).

`raw_rows_per_s` is the same rows, already in columns, inserted with clickhouse-connect into a fresh chDB
with the same schema and views, in blocks of 20,000 rows, through `Store.insert` as the collector calls it
(an Arrow table): the store's own speed, the ceiling for the collector. `raw_native_rows_per_s` is the
same with Python column lists through clickhouse-connect's Native encoder, for reference. `ratio` =
spans_per_s / raw_rows_per_s. `collector_cpu_s` is the collector process's CPU time over the measured
window, `sender_cpu_s` the senders' (this process, on the same machine). The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collector import convert, otlp  # noqa: E402
from collector.store import Store  # noqa: E402
from instrumentation import attributes as A  # noqa: E402


def make_spans(n_requests: int, seed: int = 0) -> list:
    """Realistic stepscope spans from the real SDK (recorded in memory, then encoded as the exporter does)."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    rnd = random.Random(seed)
    memory = InMemorySpanExporter()
    resource = Resource.create(
        {
            "service.name": "engine",
            A.RESOURCE_INSTANCE: "engine-0",
            A.RESOURCE_ROLE: "colocated",
            A.RESOURCE_MODEL: "tiny",
        }
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("stepscope.instrumentation", "0.1.0")
    t0, step = time.time_ns(), 0
    for r in range(n_requests):
        start, out_tokens = t0 + r * 5_000_000, rnd.randint(16, 256)
        request = tracer.start_span(A.SPAN_REQUEST, kind=trace.SpanKind.SERVER, start_time=start, attributes={
            A.GEN_AI_REQUEST_ID: f"req-{r}", A.GEN_AI_REQUEST_MODEL: "tiny", A.GEN_AI_REQUEST_MAX_TOKENS: 256,
            A.GEN_AI_REQUEST_TEMPERATURE: 0.7, A.GEN_AI_LATENCY_TTFT: rnd.random() * 0.2,
            A.GEN_AI_LATENCY_E2E: rnd.random() * 3, A.GEN_AI_LATENCY_QUEUE: rnd.random() * 0.05,
            A.GEN_AI_LATENCY_PREFILL: rnd.random() * 0.1, A.GEN_AI_LATENCY_DECODE: rnd.random() * 2.5,
            A.GEN_AI_USAGE_INPUT_TOKENS: rnd.randint(32, 2048), A.GEN_AI_USAGE_OUTPUT_TOKENS: out_tokens,
            A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 0, A.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
            A.PREFIX_KEY: f"{rnd.getrandbits(64):016x}", A.PREEMPTIONS: 0, A.TPOT_MEAN_S: 0.01,
            A.TPOT_MAX_S: 0.03, A.ITL_COUNT: out_tokens - 1,
        })  # fmt: skip
        request.add_event(A.EVENT_FIRST_TOKEN, timestamp=start + 50_000_000)
        parent = trace.set_span_in_context(request)
        for name, ms in ((A.SPAN_QUEUE, 5), (A.SPAN_PREFILL, 40), (A.SPAN_DECODE, 900)):
            extra = {A.CHUNK_INDEX: 0, A.CHUNK_TOKENS: 512} if name == A.SPAN_PREFILL else {}
            tracer.start_span(name, context=parent, start_time=start, attributes=extra).end(
                start + ms * 1_000_000
            )
        for k in range(4):
            step += 1
            at = start + k * 10_000_000
            span = tracer.start_span(
                A.SPAN_STEP, context=trace.set_span_in_context(trace.INVALID_SPAN), start_time=at,
                links=[trace.Link(request.get_span_context(), {A.LINK_TOKENS: 1})],
                attributes={
                    A.STEP_ID: step, A.STEP_NUM_RUNNING: rnd.randint(1, 32),
                    A.STEP_NUM_WAITING: rnd.randint(0, 8),
                    A.STEP_BATCH_SIZE: rnd.randint(1, 32), A.STEP_PREFILL_TOKENS: rnd.choice([0, 0, 512]),
                    A.STEP_DECODE_TOKENS: rnd.randint(1, 32), A.STEP_KV_BLOCKS_USED: rnd.randint(0, 1000),
                    A.STEP_KV_BLOCKS_FREE: rnd.randint(0, 1000), A.STEP_KV_BLOCKS_TOTAL: 2000,
                    A.STEP_PREEMPTIONS: 0, A.STEP_PREFIX_HIT_TOKENS: 0, A.STEP_WEIGHT_DTYPE: "float32",
                    A.STEP_KV_DTYPE: "float32", A.STEP_CHUNKED_PREFILL: True, A.STEP_MAX_NUM_SEQS: 32,
                    A.STEP_GAP_S: rnd.random() * 0.001, A.STEP_BYTES_READ: 123_456_789,
                },
            )  # fmt: skip
            span.end(at + 8_000_000)
        request.end(start + 1_000_000_000)
    return list(memory.get_finished_spans())


def encode_batches(spans: list, batch: int) -> list[bytes]:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return [encode_spans(spans[i : i + batch]).SerializeToString() for i in range(0, len(spans), batch)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_collector(data: Path, port: int) -> subprocess.Popen:
    log = open(data.parent / "collector.log", "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "stepscope", "collector", "--store", f"chdb://{data}",
         "--port", str(port), "--log-level", "error"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise SystemExit(f"collector did not start: {(data.parent / 'collector.log').read_text()[-500:]}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_stored(port: int, want: int, timeout_s: float = 120) -> int:
    """Poll count() until `want` spans are in otel_traces (acknowledged spans may still be spooled)."""
    deadline, got = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        r = httpx.post(f"http://127.0.0.1:{port}/api/sql", json={"sql": "SELECT count() FROM otel_traces"})
        got = r.json()["rows"][0][0]
        if got >= want:
            return got
        time.sleep(0.02)
    return got


def send_all(port: int, bodies: list[bytes], senders: int) -> float:
    """POST every body (each sender takes the next one), return the wall time until the last ack."""
    url = f"http://127.0.0.1:{port}/v1/traces"
    headers = {"Content-Type": "application/x-protobuf"}
    next_index, lock, failures = [0], threading.Lock(), []

    def sender() -> None:
        with httpx.Client(timeout=60) as client:
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= len(bodies):
                    return
                r = client.post(url, content=bodies[i], headers=headers)
                while r.status_code in (429, 503):  # backpressure: wait as told, then resend
                    time.sleep(float(r.headers.get("Retry-After", "1")))
                    r = client.post(url, content=bodies[i], headers=headers)
                if r.status_code != 200:
                    failures.append(r.status_code)

    threads = [threading.Thread(target=sender) for _ in range(senders)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    if failures:
        raise SystemExit(f"{len(failures)} batches refused: {sorted(set(failures))}")
    return elapsed


def raw_insert(data: Path, bodies: list[bytes], block_rows: int) -> dict[str, float]:
    """Insert the same rows directly, with columns built beforehand, so this times the store alone:
    through `Store.insert` as the collector calls it (an Arrow table), and, for reference, as Python
    column lists through clickhouse-connect's Native encoder. Returns rows per second of each."""
    batch = convert.merge([convert.traces(otlp.decode("traces", b, otlp.PROTOBUF).message) for b in bodies])
    names, table = batch.columns["otel_traces"], batch.tables["otel_traces"]
    n = table.num_rows
    lists = [table.column(name).to_pylist() for name in names]
    for row in range(n):  # Map columns come back from Arrow as lists of pairs; the Native encoder wants dicts
        for col in (8, 11):
            lists[col][row] = dict(lists[col][row])
        for col in (17, 21):
            lists[col][row] = [dict(m) for m in lists[col][row]]
    rates = {}
    with Store.open(f"chdb://{data}") as store:
        store.insert("otel_traces", names, table.slice(0, 1000), token="warm-up")
        store.insert("otel_traces", names, [c[:1000] for c in lists], token="warm-up-native")
        t = time.perf_counter()
        for i in range(0, n, block_rows):
            store.insert("otel_traces", names, table.slice(i, block_rows), token=f"raw-{i}")
        rates["arrow"] = n / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(0, n, block_rows):
            store.insert("otel_traces", names, [c[i : i + block_rows] for c in lists], token=f"native-{i}")
        rates["native"] = n / (time.perf_counter() - t)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=12_500, help="llm_requests to simulate (8 spans each)"
    )
    parser.add_argument("--senders", type=int, default=4, help="concurrent exporters")
    parser.add_argument("--batch", type=int, default=512, help="spans per export request")
    args = parser.parse_args()

    spans = make_spans(args.requests)
    bodies = encode_batches(spans, args.batch)
    warm = encode_batches(make_spans(200, seed=1), args.batch)
    tmp = Path(tempfile.mkdtemp(prefix="stepscope-bench-"))
    try:
        port = free_port()
        proc = start_collector(tmp / "collector-data", port)
        try:
            send_all(port, warm, 1)
            base = wait_stored(port, 200 * 8)
            cpu0, t0, senders0 = cpu_seconds(proc.pid), time.perf_counter(), time.process_time()
            acked_s = send_all(port, bodies, args.senders)
            stored = wait_stored(port, base + len(spans)) - base
            elapsed = time.perf_counter() - t0
            collector_cpu_s = cpu_seconds(proc.pid) - cpu0
            sender_cpu_s = time.process_time() - senders0
        finally:
            proc.terminate()
            proc.wait(30)
        raw = raw_insert(tmp / "raw-data", bodies, 20_000)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "spans": len(spans),
        "stored": stored,
        "batches": len(bodies),
        "batch_spans": args.batch,
        "senders": args.senders,
        "mean_body_bytes": sum(map(len, bodies)) // len(bodies),
        "seconds_to_ack": round(acked_s, 3),
        "seconds_to_store": round(elapsed, 3),
        "collector_cpu_s": round(collector_cpu_s, 2),
        "sender_cpu_s": round(sender_cpu_s, 2),
        "spans_per_s": round(len(spans) / elapsed),
        "raw_rows_per_s": round(raw["arrow"]),
        "raw_native_rows_per_s": round(raw["native"]),
        "ratio": round((len(spans) / elapsed) / raw["arrow"], 3),
        "cpus": os.cpu_count(),
    }
    print(f"collector {result['spans_per_s']} spans/s over OTLP/HTTP vs {result['raw_rows_per_s']} rows/s "
          f"direct (ratio {result['ratio']}); {stored} of {len(spans)} spans stored")  # fmt: skip
    print(json.dumps(result))
    return 0 if stored == len(spans) else 1


if __name__ == "__main__":
    sys.exit(main())
