"""On a CUDA GPU: `stepscope serve` in bf16 to a real OTLP/HTTP receiver; its spans and NVML counters.

    python benchmarks/cuda_serve.py [--model small] [--requests 64] [--concurrency 16] [--device cuda]

Starts an OTLP receiver on loopback and the server as its own process (`--device cuda --dtype bf16
--otlp-endpoint ... --trace-steps-every 1`), sends streaming completions from concurrent clients, stops
the server with SIGTERM (which flushes its exporter) and checks what a GPU user relies on:

- every request answered, with one `llm_request` span and its `queue`, `prefill` and `decode` children
  in the same trace;
- `engine.step` spans linked to the requests they advanced, with the batch size;
- NVML's counters on the steps (`stepscope.gpu.0.*`: SM clock, memory used, utilization, power,
  clock-event reasons; a step carries a sample when one was taken since the last step that did) and as
  `stepscope.gpu.*` gauges in the metrics.

Prints each check, the step time by batch size and TTFT / TPOT P50 from the spans; the last line printed
is one JSON object, also written to `benchmarks/results/<date>-<commit>-cuda_serve.json`. Exit 1 when a
check fails, 2 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from instrumentation import attributes as A
from loadgen.metrics import percentiles
from stepscope.otlp_receiver import OtlpReceiver
from stepscope.procs import Proc, free_port

GPU_COUNTERS = (A.GPU_SM_CLOCK_MHZ, A.GPU_MEMORY_USED_BYTES, A.GPU_SM_UTILIZATION, A.GPU_POWER_W)


async def send_all(url: str, model: str, n: int, concurrency: int) -> list[int]:
    """`n` streaming completions (prompt and output lengths varied), `concurrency` at a time; the number of
    text chunks each answer streamed (0: it failed)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": model,
            "prompt": f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 12),
            "max_tokens": 32 + (i * 37) % 96,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with gate, http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return 0
            return len([line async for line in resp.aiter_lines() if line.startswith("data: {")])

    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        return await asyncio.gather(*(one(http, i) for i in range(n)))


def p50_ms(spans: list[dict], key: str) -> float | None:
    """The median of attribute `key` (seconds) over the spans that have it, in milliseconds."""
    p50 = percentiles((s["attrs"][key] for s in spans if key in s["attrs"]), (50,))["p50"]
    return None if p50 is None else round(p50 * 1000, 3)


def check_spans(receiver: OtlpReceiver, n: int) -> tuple[dict[str, bool], dict[str, object]]:
    """The checks (name -> passed) and the figures read off the spans."""
    requests = receiver.named(A.SPAN_REQUEST)
    by_trace: dict[str, set[str]] = {}
    for s in receiver.spans:
        by_trace.setdefault(s["trace_id"], set()).add(s["name"])
    phases = {A.SPAN_QUEUE, A.SPAN_PREFILL, A.SPAN_DECODE}
    steps = receiver.named(A.SPAN_STEP)
    request_ids = {s["span_id"] for s in requests}
    linked = {span_id for s in steps for span_id, _ in s["links"]}
    prefix = f"{A.GPU_PREFIX}0."
    with_gpu = [s for s in steps if all(prefix + c in s["attrs"] for c in GPU_COUNTERS)]
    gauges = sorted(m for m in receiver.metrics if m.startswith(A.METRIC_GPU_PREFIX))
    checks = {
        "every request has an llm_request span": len(requests) == n,
        "every llm_request has queue, prefill and decode children": all(
            phases <= by_trace[s["trace_id"]] for s in requests
        ),
        "engine.step spans link to every request": bool(steps) and request_ids <= linked,
        "engine.step spans carry the NVML counters": bool(with_gpu),
        "the GPU gauges are exported as metrics": bool(gauges),
    }
    by_batch: dict[int, list[float]] = {}
    for s in steps:
        batch = int(s["attrs"].get(A.STEP_BATCH_SIZE, 0))
        by_batch.setdefault(batch, []).append((s["end"] - s["start"]) / 1e6)
    last = with_gpu[-1]["attrs"] if with_gpu else {}
    figures = {
        "llm_request_spans": len(requests),
        "engine_step_spans": len(steps),
        "steps_with_gpu_counters": len(with_gpu),
        "gpu_counters": {k.removeprefix(prefix): v for k, v in last.items() if k.startswith(prefix)},
        "gpu_gauges": gauges,
        "step_ms_p50_by_batch": {b: round(statistics.median(t), 3) for b, t in sorted(by_batch.items())},
        "ttft_p50_ms": p50_ms(requests, A.GEN_AI_LATENCY_TTFT),
        "tpot_p50_ms": p50_ms(requests, A.TPOT_MEAN_S),
    }
    return checks, figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    import torch

    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        print("cuda_serve: no CUDA device here", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    gpu = torch.cuda.get_device_name(0) if on_cuda else "none (a dry run on the CPU: the NVML checks fail)"
    print(f"device: {gpu}; torch {torch.__version__}", flush=True)
    receiver = OtlpReceiver()
    port = free_port()
    env = os.environ | {"OTEL_METRIC_EXPORT_INTERVAL": "1000", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = Proc(
        ["serve", "--model", args.model, "--device", args.device, "--dtype", args.dtype, "--port", str(port),
         "--otlp-endpoint", receiver.url, "--trace-steps-every", "1"],
        log,
        env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_http(f"{url}/health", timeout_s=300)
        started = time.perf_counter()
        chunks = asyncio.run(send_all(url, args.model, args.requests, args.concurrency))
        wall = time.perf_counter() - started
        time.sleep(2.5)  # one more metrics export with the load's last samples
    finally:
        code = server.stop()
    time.sleep(1)
    receiver.close()
    checks, figures = check_spans(receiver, args.requests)
    served = {"every request answered": all(chunks), "the server stopped cleanly on SIGTERM": code == 0}
    checks = served | checks
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if code != 0 or not all(chunks):
        print(server.tail(), file=sys.stderr)
    result = {
        "gpu": gpu,
        "torch": torch.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "wall_s": round(wall, 2),
        "output_chunks_per_s": round(sum(chunks) / wall, 1),
        "checks": checks,
        "passed": all(checks.values()),
    } | figures
    path = results.write("cuda_serve", result, vars(args), load_before)
    print(f"written to {path}", file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
