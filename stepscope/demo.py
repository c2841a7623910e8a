"""`stepscope demo`: serve a model and stream a completion to the terminal.

For now the main job is the engine alone: start `stepscope serve`, wait for it, stream one chat
completion token by token, print what it cost (TTFT, TPOT), stop the server. The full demo
(collector, load, a fault, the diagnosis) replaces this as its parts land.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from stepscope.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small", help="preset or checkpoint dir to serve")
    parser.add_argument("--prompt", default="Tell me a story about a paged KV cache.")
    parser.add_argument("--max-tokens", type=int, default=64)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    port = _free_port()
    cmd = [sys.executable, "-m", "stepscope", "serve", "--model", args.model, "--port", str(port)]
    print(f"starting: stepscope serve --model {args.model} --port {port}", flush=True)
    server = subprocess.Popen(cmd, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, server)
        _stream(base, args.prompt, args.max_tokens)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(base: str, server: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise UsageError(f"the server exited with code {server.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise UsageError("the server did not become healthy in time")


def _stream(base: str, prompt: str, max_tokens: int) -> None:
    body = {
        "model": httpx.get(f"{base}/v1/models").json()["data"][0]["id"],
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    print(f"\n> {prompt}\n", flush=True)
    start = time.perf_counter()
    token_times: list[float] = []
    usage = {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    token_times.append(time.perf_counter())
                    print(text, end="", flush=True)
    ttft = token_times[0] - start if token_times else float("nan")
    gaps = [b - a for a, b in itertools.pairwise(token_times)]
    tpot = sum(gaps) / len(gaps) if gaps else float("nan")
    print(f"\n\nTTFT {ttft * 1000:.0f} ms, TPOT {tpot * 1000:.1f} ms, usage {usage}")
