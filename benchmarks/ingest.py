"""Ingest throughput: OTLP/HTTP protobuf into a running collector (chDB) vs the same rows inserted directly.

    python benchmarks/ingest.py [--requests 12500] [--senders 4] [--batch 512] [--rounds 3]

Spans are made by the OpenTelemetry SDK the way stepscope's instrumentation makes them (per request: an
`llm_request` SERVER span with the GenAI latency attributes and a first_token event, queue/prefill/decode
children, and four `engine.step` spans with ~20 attributes and a link each), encoded by the OTLP exporter's
own encoder in batches of 512 (the BatchSpanProcessor's default), and POSTed by `--senders` concurrent
clients (several engine processes) to `stepscope collector` started as a real process. `spans_per_s` is
spans per second of wall time from the first POST until `count()` in otel_traces shows every one of them
(acknowledged and queryable, not just acknowledged).

`raw_rows_per_s` is the baseline: the same rows, already in Python columns (a dict per Map
value, as clickhouse-connect takes them), inserted with clickhouse-connect's column-oriented native insert
(`client.insert(..., column_oriented=True)`, through `Store.insert`) into a fresh chDB with the same schema
and materialized views (`Store.open` applies the same migrations), in blocks of `GROUP_MIN_ROWS` (20,000)
rows, the size the collector waits for before it inserts (under load its groups are larger, up to
`GROUP_MAX_ROWS`, which favours the baseline). It is timed like the collector leg: after a warm-up insert
of a full group (`WARM_REQUESTS`) that is not counted, until `count()` shows every row. `ratio` =
spans_per_s / raw_rows_per_s: what the collector keeps of a plain insert into the same tables, while it
also parses OTLP, converts values to the exporter's encodings and fsyncs every batch before it answers.

`raw_arrow_rows_per_s` is the same with the rows as one Arrow table (built beforehand, sliced into the same
blocks): ClickHouse parses Arrow natively, with no per-value Python work, so this is the store's own
speed for these tables, a ceiling no receiver that does its own decoding reaches. `ratio_vs_arrow` =
spans_per_s / raw_arrow_rows_per_s. Each raw leg runs in a fresh process of its own (as the collector
does) after the collector has stopped. `*_cpu_us` are CPU microseconds per span or row of each leg: less
moved by the neighbours' load than the rates.

The three legs run in turn `--rounds` times (a fresh store each time), since a shared host's speed moves
from one minute to the next by up to a half: each figure is the median over the rounds, each ratio the
median of the rounds' own ratios (`*_rounds` lists them), and `collector_cpu_vs_arrow` is
`collector_cpu_us / raw_arrow_cpu_us` taken round by round.

`collector_cpu_s` is the collector process's CPU time (its worker processes included) over the measured
window, `sender_cpu_s` the senders' (this process, on the same machine). `collector_rss_mb` is the
collector's peak resident memory (the sum of each of its processes' high-water mark; the largest of the
rounds), chDB included. The last line is one JSON object; the same goes to
`benchmarks/results/<date>-<commit>-ingest.json` with the CPU model, core count, load average before and
after, and the arguments (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import results  # noqa: E402
from collector import convert  # noqa: E402
from collector.ingest import GROUP_MIN_ROWS  # noqa: E402
from collector.store import Store  # noqa: E402
from instrumentation import attributes as A  # noqa: E402
from stepscope.procs import free_port  # noqa: E402

# Both legs insert a full group's worth of spans (6,250 requests, 50,000 spans) before the timed part, unseen:
# a collector that has run a while has taken groups this size, and the first large insert of a process
# costs about twice the next ones (its buffers are touched for the first time).
WARM_REQUESTS = 6_250


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


def cpu_seconds(session: int) -> float:
    """User + system CPU time so far of every process in a session (the collector and its workers)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[3]) == session:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(session: int) -> float:
    """The summed peak resident set (VmHWM) of every process in a session, in MiB."""
    total_kb = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            stat = (status.parent / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[3]) != session:
                continue
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kb += int(line.split()[1])
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
    return total_kb / 1024


def wait_stored(port: int, want: int, timeout_s: float = 120) -> int:
    """Wait until `want` spans are in otel_traces (acknowledged spans may still be spooled): poll /health
    until nothing is spooled, then count(). /health costs the collector far less than a query would, so
    the polling takes little of the CPU being measured; one client polls (making an httpx client loads
    the TLS trust store: tens of milliseconds of CPU, taken from the collector if done per poll)."""
    deadline, got = time.monotonic() + timeout_s, -1
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, trust_env=False) as http:
        while time.monotonic() < deadline:
            if http.get("/health").json()["spooled_batches"]:
                time.sleep(0.02)
                continue
            r = http.post("/api/sql", json={"sql": "SELECT count() FROM otel_traces"})
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


def raw_columns(bodies: list[bytes], how: str) -> tuple[tuple[str, ...], list]:
    """The collector's rows of `bodies`, as one Arrow table ("arrow") or as Python column lists with a dict
    per Map value ("native", what clickhouse-connect's column-oriented insert takes)."""
    batch = convert.merge([convert.traces_payload(b) for b in bodies])
    names, table = batch.columns["otel_traces"], batch.tables["otel_traces"]
    if how == "arrow":
        return names, table
    lists = [table.column(name).to_pylist() for name in names]
    for row in range(table.num_rows):  # Map columns come back from Arrow as lists of pairs
        for col in (8, 11):
            lists[col][row] = dict(lists[col][row])
        for col in (17, 21):
            lists[col][row] = [dict(m) for m in lists[col][row]]
    return names, lists


def raw_leg(how: str, bodies_path: Path, data: Path, block_rows: int) -> dict[str, float]:
    """Insert the rows of the bodies directly into a fresh store with the collector's schema, in blocks of
    `block_rows`: warm-up first (not counted), then timed until count() shows every row."""
    bodies = pickle.loads(bodies_path.read_bytes())
    warm_names, warm = raw_columns(encode_batches(make_spans(WARM_REQUESTS, seed=1), 512), how)
    names, columns = raw_columns(bodies, how)
    n = columns.num_rows if how == "arrow" else len(columns[0])
    with Store.open(f"chdb://{data}") as store:
        store.insert("otel_traces", warm_names, warm, token="warm-up")
        base = store.query("SELECT count() FROM otel_traces").rows[0][0]
        cpu0, t = time.process_time(), time.perf_counter()
        for i in range(0, n, block_rows):
            end = i + block_rows
            block = columns.slice(i, block_rows) if how == "arrow" else [c[i:end] for c in columns]
            store.insert("otel_traces", names, block, token=f"raw-{i}")
        stored = store.query("SELECT count() FROM otel_traces").rows[0][0] - base
        elapsed = time.perf_counter() - t
        cpu_s = time.process_time() - cpu0
    return {"rows": n, "stored": stored, "rows_per_s": n / elapsed, "cpu_s": cpu_s}


def run_raw_leg(how: str, bodies_path: Path, data: Path, block_rows: int) -> dict[str, float]:
    """`raw_leg` in a fresh process (chDB holds one directory per process, as in the collector)."""
    out = subprocess.run(
        [sys.executable, __file__, "--raw-leg", how, "--bodies", str(bodies_path), "--store", str(data),
         "--block-rows", str(block_rows)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def collector_leg(
    data: Path, bodies: list[bytes], warm: list[bytes], n_spans: int, senders: int
) -> dict[str, float]:
    """One round's collector leg: a fresh `stepscope collector`, the `warm` bodies (a full group, not
    counted), then every body from `senders` clients, timed until count() shows all `n_spans` spans."""
    port = free_port()
    proc = start_collector(data, port)
    try:
        send_all(port, warm, 1)
        base = wait_stored(port, WARM_REQUESTS * 8)
        cpu0, t0, senders0 = cpu_seconds(proc.pid), time.perf_counter(), time.process_time()
        acked_s = send_all(port, bodies, senders)
        stored = wait_stored(port, base + n_spans) - base
        elapsed = time.perf_counter() - t0
        return {
            "stored": stored, "seconds_to_ack": acked_s, "seconds_to_store": elapsed,
            "cpu_s": cpu_seconds(proc.pid) - cpu0, "sender_cpu_s": time.process_time() - senders0,
            "rss_mb": peak_rss_mb(proc.pid), "spans_per_s": n_spans / elapsed,
        }  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(30)


def median(values: list[float], digits: int) -> float:
    return round(statistics.median(values), digits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=12_500, help="llm_requests to simulate (8 spans each)"
    )
    parser.add_argument("--senders", type=int, default=4, help="concurrent exporters")
    parser.add_argument("--batch", type=int, default=512, help="spans per export request")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the three legs, in turn; figures are the medians"
    )
    parser.add_argument("--raw-leg", choices=["native", "arrow"], help=argparse.SUPPRESS)  # internal
    parser.add_argument("--bodies", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--block-rows", type=int, default=GROUP_MIN_ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_leg:
        print(json.dumps(raw_leg(args.raw_leg, args.bodies, args.store, args.block_rows)))
        return 0
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    load_before = os.getloadavg()
    spans = make_spans(args.requests)
    bodies = encode_batches(spans, args.batch)
    warm = encode_batches(make_spans(WARM_REQUESTS, seed=1), args.batch)
    n = len(spans)
    rounds: list[dict[str, dict[str, float]]] = []
    tmp = Path(tempfile.mkdtemp(prefix="stepscope-bench-"))
    try:
        (tmp / "bodies.pickle").write_bytes(pickle.dumps(bodies))
        for r in range(args.rounds):
            legs = {"collector": collector_leg(tmp / f"collector-{r}", bodies, warm, n, args.senders)}
            for how in ("native", "arrow"):
                legs[how] = run_raw_leg(how, tmp / "bodies.pickle", tmp / f"raw-{how}-{r}", args.block_rows)
            rounds.append(legs)
            c, a = legs["collector"], legs["arrow"]
            c_us, a_us = c["cpu_s"] / n * 1e6, a["cpu_s"] / a["rows"] * 1e6
            print(f"round {r + 1}: collector {c['spans_per_s']:,.0f} spans/s, {c_us:.1f} us a span; Arrow "
                  f"insert {a['rows_per_s']:,.0f} rows/s, {a_us:.1f} us a row; {c['stored']} of {n} stored",
                  file=sys.stderr)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def per_round(f) -> list[float]:
        return [f(legs) for legs in rounds]

    spans_per_s = per_round(lambda g: g["collector"]["spans_per_s"])
    collector_us = per_round(lambda g: g["collector"]["cpu_s"] / n * 1e6)
    raw_us = per_round(lambda g: g["native"]["cpu_s"] / g["native"]["rows"] * 1e6)
    arrow_us = per_round(lambda g: g["arrow"]["cpu_s"] / g["arrow"]["rows"] * 1e6)
    ratio = per_round(lambda g: g["collector"]["spans_per_s"] / g["native"]["rows_per_s"])
    ratio_arrow = per_round(lambda g: g["collector"]["spans_per_s"] / g["arrow"]["rows_per_s"])
    cpu_vs_arrow = [c / a for c, a in zip(collector_us, arrow_us, strict=True)]
    stored = min(per_round(lambda g: g["collector"]["stored"]))
    result = {
        "spans": n,
        "stored": stored,
        "batches": len(bodies),
        "batch_spans": args.batch,
        "senders": args.senders,
        "rounds": args.rounds,
        "mean_body_bytes": sum(map(len, bodies)) // len(bodies),
        "raw_block_rows": args.block_rows,
        "seconds_to_ack": median(per_round(lambda g: g["collector"]["seconds_to_ack"]), 3),
        "seconds_to_store": median(per_round(lambda g: g["collector"]["seconds_to_store"]), 3),
        "collector_cpu_s": median(per_round(lambda g: g["collector"]["cpu_s"]), 2),
        "sender_cpu_s": median(per_round(lambda g: g["collector"]["sender_cpu_s"]), 2),
        "collector_cpu_us": median(collector_us, 1),
        "collector_rss_mb": round(max(per_round(lambda g: g["collector"]["rss_mb"]))),
        "raw_cpu_us": median(raw_us, 1),
        "raw_arrow_cpu_us": median(arrow_us, 1),
        "collector_cpu_vs_arrow": median(cpu_vs_arrow, 3),
        "spans_per_s": round(statistics.median(spans_per_s)),
        "raw_rows_per_s": round(statistics.median(per_round(lambda g: g["native"]["rows_per_s"]))),
        "raw_arrow_rows_per_s": round(statistics.median(per_round(lambda g: g["arrow"]["rows_per_s"]))),
        "ratio": median(ratio, 3),
        "ratio_vs_arrow": median(ratio_arrow, 3),
        "spans_per_s_rounds": [round(v) for v in spans_per_s],
        "collector_cpu_us_rounds": [round(v, 1) for v in collector_us],
        "raw_arrow_cpu_us_rounds": [round(v, 1) for v in arrow_us],
        "collector_cpu_vs_arrow_rounds": [round(v, 3) for v in cpu_vs_arrow],
        "ratio_vs_arrow_rounds": [round(v, 3) for v in ratio_arrow],
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    complete = stored == n and all(
        g[how]["stored"] == g[how]["rows"] for g in rounds for how in ("native", "arrow")
    )
    print(f"collector {result['spans_per_s']} spans/s over OTLP/HTTP vs {result['raw_rows_per_s']} rows/s "
          f"column-oriented insert (ratio {result['ratio']}), {result['raw_arrow_rows_per_s']} rows/s Arrow "
          f"insert (ratio {result['ratio_vs_arrow']}); CPU {result['collector_cpu_us']} us a span against "
          f"Arrow's {result['raw_arrow_cpu_us']} (x{result['collector_cpu_vs_arrow']}); medians of "
          f"{args.rounds} rounds; {stored} of {n} spans stored in each")  # fmt: skip
    print(json.dumps(result))
    arguments = {
        k: v for k, v in vars(args).items() if k in ("requests", "senders", "batch", "block_rows", "rounds")
    }
    print(f"wrote {results.write('ingest', result, arguments, load_before)}", file=sys.stderr)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
