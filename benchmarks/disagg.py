"""Disaggregation against colocation on the same cores: chat latency under a steady stream of long prompts.

    python benchmarks/disagg.py [--model small] [--duration 60] [--threads 2] [--chat-rate R] [--doc-rate R]

Two deployments of the same model, one after the other, each with the same core budget (`--threads`):
- colocated: `stepscope serve --num-threads T --no-enable-chunked-prefill` (chunked prefill off, as most
  deployments start: a long prompt is prefilled whole in a step that also carries every running decode);
- disaggregated: `stepscope serve --disagg --num-threads T` (1 prefill + 1 decode worker, T/2 threads each).
Each gets two warm-up requests, then the same seeded open-loop Poisson traffic from the load generator's
library: chat (short prompts, 24-token answers) and summarization (1024-token documents, 8-token answers).
Figures are client-side, for the chat requests: P99 TTFT and TPOT; ratios are disaggregated over colocated.
The KV bandwidth is the prefill worker's bytes sent over its time spent writing (router /metrics).
The last line printed is one JSON object; the same goes to `benchmarks/results/<date>-<commit>-disagg.json`
with the CPU model, core count, load average before and after, and the arguments (stepscope/results.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from loadgen.metrics import percentiles
from loadgen.runner import LoadSpec, RunOptions, run_load
from loadgen.workloads import LengthDist, Workload, WorkloadConfig
from stepscope import results

STEPSCOPE = str(Path(sys.executable).with_name("stepscope"))


def start(model: str, log: Path, options: list[str]) -> tuple[subprocess.Popen, str]:
    """A server in its own session; (process, URL) once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [STEPSCOPE, "serve", "--model", model, "--port", str(port), "--max-num-seqs", "32", *options]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-1500:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def workloads(seed: int) -> tuple[Workload, Workload]:
    cfg = WorkloadConfig(
        seed=seed,
        chat_prompt=LengthDist(64, 0.5, 16, 256),
        chat_output=LengthDist(24, 0.0, 24, 24),
        summarize_prompt=LengthDist(1024, 0.2, 768, 1536),
        summarize_output=LengthDist(8, 0.0, 8, 8),
    )
    return Workload.load("chat", cfg), Workload.load("summarize", replace(cfg, seed=seed + 7919))


async def drive(url: str, args: argparse.Namespace) -> list:
    chat, docs = workloads(args.seed)
    opts = RunOptions(model=args.model, timeout_s=600, drain_timeout_s=240, seed=args.seed)
    runs = await asyncio.gather(
        run_load(url, chat, LoadSpec(rate=args.chat_rate, duration_s=args.duration), opts),
        run_load(
            url,
            docs,
            LoadSpec(rate=args.doc_rate, duration_s=args.duration),
            replace(opts, first_index=10**6),
        ),
    )
    return [r for run in runs for r in run.records]


def figures(records: list) -> dict[str, float | int | None]:
    chat = [r for r in records if r.kind == "chat" and r.ok]
    docs = [r for r in records if r.kind == "summarize" and r.ok]
    ttft = percentiles(r.ttft_s for r in chat)
    tpot = percentiles(r.tpot_s for r in chat)
    doc_ttft = percentiles(r.ttft_s for r in docs)
    return {
        "chat_completed": len(chat),
        "docs_completed": len(docs),
        "errors": sum(1 for r in records if not r.ok),
        "error_kinds": sorted({f"{r.error}: {(r.error_detail or '')[:90]}" for r in records if not r.ok})[:3],
        "chat_ttft_p50_s": ttft["p50"],
        "chat_ttft_p99_s": ttft["p99"],
        "chat_tpot_p50_s": tpot["p50"],
        "chat_tpot_p99_s": tpot["p99"],
        "doc_ttft_p50_s": doc_ttft["p50"],
    }


def kv_bandwidth(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    sent, busy = (
        total("stepscope:kv_transfer_bytes_sent_total"),
        total("stepscope:kv_transfer_send_seconds_total"),
    )
    return {
        "kv_bytes_sent": sent,
        "kv_bytes_received": total("stepscope:kv_transfer_bytes_received_total"),
        "kv_transfers": total("stepscope:kv_transfers_sent_total"),
        "kv_bandwidth_mb_s": round(sent / busy / 1e6, 1) if busy else None,
    }


def run_one(name: str, options: list[str], args: argparse.Namespace, tmp: Path) -> dict:
    proc, url = start(args.model, tmp / f"{name}.log", options)
    try:
        for i in range(2):  # warm-up, unrecorded
            httpx.post(
                url + "/v1/completions", json={"prompt": f"warm up {i} " * 60, "max_tokens": 4}, timeout=120
            )
        t0 = time.monotonic()
        out = figures(asyncio.run(drive(url, args)))
        out["wall_s"] = round(time.monotonic() - t0, 1)
        if "--disagg" in options:
            out.update(kv_bandwidth(url))
        return out
    finally:
        stop(proc)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per deployment")
    p.add_argument("--threads", type=int, default=2, help="the core budget of each deployment")
    p.add_argument("--chat-rate", type=float, default=1.0, help="chat requests/s")
    p.add_argument("--doc-rate", type=float, default=0.25, help="summarization requests/s")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tmp", default="/tmp/stepscope-bench-disagg")
    args = p.parse_args()
    load_before = os.getloadavg()
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    threads = [
        "--num-threads",
        str(args.threads),
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "2048",
    ]
    colocated = run_one("colocated", threads, args, tmp)
    print(f"colocated: {json.dumps(colocated)}", file=sys.stderr, flush=True)
    disagg = run_one("disagg", [*threads, "--disagg"], args, tmp)
    print(f"disaggregated: {json.dumps(disagg)}", file=sys.stderr, flush=True)
    result = {
        "model": args.model,
        "threads": args.threads,
        "duration_s": args.duration,
        "chat_rate": args.chat_rate,
        "doc_rate": args.doc_rate,
        "tpot_p99_ratio": ratio(disagg["chat_tpot_p99_s"], colocated["chat_tpot_p99_s"]),
        "ttft_p99_ratio": ratio(disagg["chat_ttft_p99_s"], colocated["chat_ttft_p99_s"]),
        "kv_bandwidth_mb_s": disagg.get("kv_bandwidth_mb_s"),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "colocated": colocated,
        "disaggregated": disagg,
    }
    tp = result["tpot_p99_ratio"]
    print(
        f"chat TPOT p99 x{tp} (target <= 0.7), TTFT p99 x{result['ttft_p99_ratio']}, "
        f"KV link {result['kv_bandwidth_mb_s']} MB/s",
        file=sys.stderr,
    )
    print(f"wrote {results.write('disagg', result, vars(args), load_before)}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
