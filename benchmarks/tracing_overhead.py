"""What tracing costs: the same workload through `stepscope serve` with tracing off and on.

    python benchmarks/tracing_overhead.py [--model small] [--rounds 3] [--requests 48]

Two servers run side by side, one without telemetry and one with `--otlp-endpoint` exporting
over OTLP/HTTP (protobuf) to a live receiver in a process of its own (it decodes each export to
count the spans, as a collector would; inside this process its decoding would take the GIL from the
load generator during the traced runs only). Runs alternate off/on in ABBA order after one warm-up
run each, so drift on a shared machine falls on both sides. Round r sends both servers the same
requests, seeded by r (prompt token ids, greedy, EOS ignored) with a fixed concurrency; no round repeats
another's prompts, so neither server's prefix cache serves a prompt it saw in an earlier run (with one
workload for every run, the runs got faster as the cache warmed, and ABBA order left that drift on one
side). Throughput is output tokens over wall time. Both servers use `--num-threads 1` by default: on a
shared 2-core machine, torch's two intra-op threads stall each other whenever another process takes a
core, which swamps what is measured.
Besides wall-clock throughput it reports CPU seconds per output token of all of each server's
processes (front end, core, and the traced core's exporter process; the traced server's split is
`on_cpu_ms_per_tok_by_process`), which other load disturbs less: `cpu_overhead_pct`.
A third figure does not depend on other load at all: the same workload runs once in this process
with events recorded, and the span building plus OTLP protobuf encoding of everything the core's
exporter would export is timed on its own (thread CPU time), per output token, against the untraced
server's CPU per token: `est_overhead_pct` (the front end's per-request span is left out: ~0.2 ms a
request). The last line printed is one JSON object: off_tok_s, on_tok_s (medians), overhead_pct,
the per-pair overheads, the load average, the runs; the same goes to
`benchmarks/results/<date>-<commit>-tracing_overhead.json` with the CPU model, core count, load average
before and after, and the arguments (stepscope/results.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from pathlib import Path

import httpx

from stepscope import results
from stepscope.procs import Proc, free_port

STEPSCOPE = str(Path(sys.executable).with_name("stepscope"))


class Receiver:
    """OTLP/HTTP receiver in a process of its own (its decoding must not take the GIL from this
    process's load generator during the traced runs only); it decodes each trace export and counts
    spans by name, as a collector would. `counts()` asks it for the totals."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receive, args=(child,), daemon=True)
        self.proc.start()
        self.url = self._conn.recv()

    def counts(self) -> dict[str, int]:
        self._conn.send("counts")
        return self._conn.recv()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.join(5)


def _receive(conn: Connection) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    counts: dict[str, int] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/v1/traces":
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            counts[s.name] = counts.get(s.name, 0) + 1
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conn.send(f"http://127.0.0.1:{server.server_address[1]}")
    while conn.recv() == "counts":
        conn.send(dict(counts))


def start_server(model: str, log: Path, options: list[str]) -> tuple[Proc, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = Proc(["serve", "--model", model, "--port", str(port), *options], log, env, program=[STEPSCOPE])
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", 300)
    except RuntimeError as e:
        proc.stop()
        sys.exit(f"server did not come up: {e}")
    return proc, url


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (a server: front end, core, and the core's exporter process)."""
    pids, i = [pid], 0
    while i < len(pids):
        p = pids[i]
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                pids += map(int, (task / "children").read_text().split())
        i += 1
    return pids


def cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU of a server's processes, by role: frontend, core, exporter."""
    out = {"frontend": 0.0, "core": 0.0, "exporter": 0.0}
    for p in process_tree(pid):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        role = "core" if b"engine.core_proc" in cmdline else "frontend"
        role = "exporter" if b"instrumentation.exporter_proc" in cmdline else role
        out[role] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return out


def tracing_cpu_ms_per_token(model: str, bodies: list[dict], concurrency: int, steps_every: int) -> float:
    """CPU of building and encoding the core's spans for this workload, per output token."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from engine.config import EngineConfig, SamplingParams
    from engine.core import EngineCore
    from engine.request import EngineRequest
    from instrumentation.config import TelemetryConfig
    from instrumentation.providers import Telemetry
    from instrumentation.step_spans import StepTracer

    class Encoding(SpanExporter):  # what the OTLP/HTTP exporter does before it sends
        def export(self, spans):
            encode_spans(spans).SerializePartialToString()
            return SpanExportResult.SUCCESS

    core = EngineCore(EngineConfig(model=model, num_threads=1), record_events=True)
    pending, events, produced, n = list(bodies), [], 0, 0
    while pending or core.has_unfinished_requests():
        while pending and core.num_running + core.num_waiting < concurrency:
            b, n = pending.pop(0), n + 1
            sampling = SamplingParams(max_tokens=b["max_tokens"], temperature=0, ignore_eos=True)
            core.add_request(
                EngineRequest(f"r{n}", b["prompt"], sampling, trace_context=f"00-{n:032x}-{n:016x}-01")
            )
        produced += sum(len(o.new_token_ids) for o in core.step())
        events.append(core.drain_events())
    config = TelemetryConfig(model=model, steps_every=steps_every)
    tracer = StepTracer(Telemetry(config, Encoding(), process="core", batch=False))
    start = time.thread_time()
    for step_events in events:
        tracer.consume(step_events)
    return (time.thread_time() - start) / produced * 1e3


def workload(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "prompt": [rng.randrange(256) for _ in range(rng.randint(32, 256))],
            "max_tokens": rng.randint(32, 96),
            "temperature": 0,
            "ignore_eos": True,
        }
        for _ in range(n)
    ]


async def run_load(url: str, bodies: list[dict], concurrency: int) -> tuple[float, float]:
    """Output tokens per second for `bodies`, `concurrency` requests in flight, and the mean running
    batch (`vllm:num_requests_running`, read every 0.25 s): a front end slow to hand the core new
    requests shows as a smaller batch, whatever the machine's load."""
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    produced = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal produced
        while not queue.empty():
            body = queue.get_nowait()
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            produced += r.json()["usage"]["completion_tokens"]

    running: list[float] = []

    async def watch(client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(0.25)
            for line in (await client.get(url + "/metrics")).text.splitlines():
                if line.startswith("vllm:num_requests_running"):
                    running.append(float(line.rsplit(" ", 1)[1]))

    async with httpx.AsyncClient(timeout=600) as client:
        watcher = asyncio.create_task(watch(client))
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        watcher.cancel()
    assert produced == sum(b["max_tokens"] for b in bodies)
    return produced / elapsed, statistics.fmean(running) if running else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument(
        "--rounds", type=int, default=3, help="ABBA rounds after the warm-up (default: %(default)s)"
    )
    p.add_argument("--requests", type=int, default=48, help="requests per run (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: %(default)s)")
    p.add_argument("--trace-steps-every", default="1", help="the traced server's step sampling")
    p.add_argument("--threads", default="1", help="torch threads of each server (default: %(default)s)")
    p.add_argument("--logs", default="/tmp/stepscope-tracing-overhead", help="server logs go here")
    args = p.parse_args()
    load_before = os.getloadavg()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    receiver = Receiver()
    common = ["--num-threads", args.threads]
    servers = {
        "off": start_server(args.model, logs / "off.log", common),
        "on": start_server(
            args.model,
            logs / "on.log",
            [*common, "--otlp-endpoint", receiver.url, "--trace-steps-every", args.trace_steps_every],
        ),
    }
    bodies = workload(args.requests, seed=0)  # the warm-up's, and the one the span-cost estimate replays
    runs: dict[str, list[float]] = {"off": [], "on": []}
    cpu_per_tok: dict[str, list[float]] = {"off": [], "on": []}
    batch: dict[str, list[float]] = {"off": [], "on": []}
    by_process: dict[str, list[float]] = {"frontend": [], "core": [], "exporter": []}  # the traced server
    try:
        for mode in ("off", "on"):  # warm-up: first-call costs (allocations, imports) left out
            asyncio.run(run_load(servers[mode][1], bodies, args.concurrency))
        for r in range(args.rounds):
            round_bodies = workload(args.requests, seed=1 + r)
            tokens_per_run = sum(b["max_tokens"] for b in round_bodies)
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                cpu0 = cpu_seconds(servers[mode][0].pid)
                tok_s, mean_running = asyncio.run(run_load(servers[mode][1], round_bodies, args.concurrency))
                batch[mode].append(mean_running)
                cpu1 = cpu_seconds(servers[mode][0].pid)
                cpu_ms = (sum(cpu1.values()) - sum(cpu0.values())) / tokens_per_run * 1e3
                runs[mode].append(tok_s)
                cpu_per_tok[mode].append(cpu_ms)
                if mode == "on":
                    for role in by_process:
                        by_process[role].append((cpu1[role] - cpu0[role]) / tokens_per_run * 1e3)
                print(
                    f"round {r} {mode:>3}: {tok_s:8.1f} tok/s {cpu_ms:6.2f} CPU ms/tok "
                    f"mean running {mean_running:5.2f} (load average {os.getloadavg()[0]:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
        time.sleep(2)  # let the batch processor deliver the last spans
    finally:
        for proc, _ in servers.values():
            proc.stop()
        time.sleep(1)  # the exporter's final flush
        spans_received = receiver.counts()
        receiver.close()
    tracing_ms = tracing_cpu_ms_per_token(args.model, bodies, args.concurrency, int(args.trace_steps_every))
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    cpu_off, cpu_on = statistics.median(cpu_per_tok["off"]), statistics.median(cpu_per_tok["on"])
    result = {
        "model": args.model,
        "requests_per_run": args.requests,
        "concurrency": args.concurrency,
        "trace_steps_every": int(args.trace_steps_every),
        "off_tok_s": round(off, 1),
        "on_tok_s": round(on, 1),
        "overhead_pct": round((off - on) / off * 100, 2),
        "off_cpu_ms_per_tok": round(cpu_off, 3),
        "on_cpu_ms_per_tok": round(cpu_on, 3),
        "cpu_overhead_pct": round((cpu_on - cpu_off) / cpu_off * 100, 2),
        "on_cpu_ms_per_tok_by_process": {k: round(statistics.median(v), 4) for k, v in by_process.items()},
        "tracing_cpu_ms_per_tok": round(tracing_ms, 4),
        "est_overhead_pct": round(tracing_ms / cpu_off * 100, 2),
        "threads": int(args.threads),
        "runs_off_tok_s": [round(x, 1) for x in runs["off"]],
        "runs_on_tok_s": [round(x, 1) for x in runs["on"]],
        "off_mean_running": round(statistics.median(batch["off"]), 2),
        "on_mean_running": round(statistics.median(batch["on"]), 2),
        "pair_overhead_pct": [
            round((a - b) / a * 100, 2) for a, b in zip(runs["off"], runs["on"], strict=True)
        ],
        "load_average": round(os.getloadavg()[0], 2),
        "spans_received": dict(sorted(spans_received.items())),
    }
    print(
        f"tracing overhead: {result['overhead_pct']}% throughput ({on:.1f} vs {off:.1f} tok/s), "
        f"{result['cpu_overhead_pct']}% CPU per token, {result['est_overhead_pct']}% estimated from the "
        f"span building and encoding cost ({args.model})"
    )
    print(f"wrote {results.write('tracing_overhead', result, vars(args), load_before)}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
