"""Routing a fleet: cache reuse and throughput by policy, the cost of one decision, the router's latency.

    python benchmarks/routing.py [--model small] [--requests 120] [--clients 6]

1. A shared-prefix workload (`--prefixes` tenants' system prompts of `--prefix-tokens` tokens, a short
   question each, seeded) in a closed loop of `--clients`, sent to:
   - one engine holding the fleet's whole KV budget (`--kv-blocks` x 3): `single_instance_cached_share`;
   - `serve --replicas 3 --routing prefix_aware` and `--routing round_robin`, each replica with
     `--kv-blocks` (a third of the prefixes fit one replica's pool, all of them fit the fleet's):
     `prefix_aware_cached_share`, `round_robin_cached_share`, and `tput_ratio`, prefix_aware's requests/s
     over round_robin's.
   The cached share is the sum of `usage.prompt_tokens_details.cached_tokens` over the prompt tokens.
2. `route_p99_us_64` (and `route_p50_us_64`): one decision (the hashes of a 512-token prompt, the choice
   among 64 synthetic replicas each remembering 2,000 KV blocks of other prompts, the bookkeeping) timed
   in process, over 5,000 decisions, with the router's default `hash_blocks`; on a loaded machine the P99
   is the scheduler's time slices, not the decision.
3. `router_ttft_p50_overhead_ms`: `serve --replicas 1`; requests alternate between the router and the
   replica's own port (the same engine), streaming, one at a time; P50 TTFT through the router minus
   P50 direct.
The last line printed is one JSON object; the same goes to `benchmarks/results/<date>-<commit>-routing.json`
with the CPU model, core count, load average before and after, and the arguments (stepscope/results.py).
Figures from a shared machine move with its neighbours' load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.fleet.routing import Replica, Router, RoutingConfig, block_hashes
from stepscope import results
from stepscope.procs import Proc, free_port


def serve(log: Path, model: str, *options: str) -> tuple[Proc, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = Proc(["serve", "--model", model, "--port", str(port), *options], log, env)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/health", 300)
    return proc, url


def prompts(n: int, prefixes: int, prefix_tokens: int, seed: int = 0) -> list[str]:
    """`n` prompts: one of `prefixes` long system texts (byte tokenizer: a character is a token) and a
    short question."""
    rng = random.Random(seed)
    words = ["ka", "to", "ri", "mu", "sen", "la", "vo", "pe", "di", "nor"]
    systems = [
        "".join(rng.choice(words) for _ in range(prefix_tokens))[:prefix_tokens] for _ in range(prefixes)
    ]
    return [rng.choice(systems) + f"\nquestion {i}: " + " ".join(rng.choices(words, k=12)) for i in range(n)]


async def closed_loop(url: str, texts: list[str], clients: int) -> dict[str, float]:
    """Send every prompt with `clients` in flight; requests/s and the cached share of prompt tokens."""
    queue = list(texts)
    cached = total = 0
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:

        async def client() -> None:
            nonlocal cached, total
            while queue:
                text = queue.pop(0)
                body = {"prompt": text, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
                r = (await http.post(url + "/v1/completions", json=body)).json()["usage"]
                cached += r["prompt_tokens_details"]["cached_tokens"]
                total += r["prompt_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - t0
    return {"rps": len(texts) / seconds, "cached_share": cached / total}


def route_us(replicas: int = 64, decisions: int = 5000, hash_blocks: int = 4) -> tuple[float, float]:
    """(P50, P99) microseconds of one prefix-aware decision among `replicas` synthetic replicas."""
    rng = random.Random(1)
    fleet = [Replica(f"r{i}", index_blocks=4096 // hash_blocks) for i in range(replicas)]
    router = Router(fleet, RoutingConfig(hash_blocks=hash_blocks))
    texts = [[rng.randrange(256) for _ in range(512)] for _ in range(200)]
    for r in fleet:  # each remembers 2,000 KV blocks of other prompts
        r.remember(block_hashes([rng.randrange(256) for _ in range(2000 * 16)], 16 * hash_blocks))
    times = []
    for i in range(decisions):
        ids = texts[i % len(texts)]
        t0 = time.perf_counter_ns()
        hashes = router.hashes(ids, 16)
        d = router.choose(hashes)
        router.started(d, hashes)
        times.append(time.perf_counter_ns() - t0)
        router.finished(d.replica)
    q = statistics.quantiles(times, n=100)
    return q[49] / 1e3, q[98] / 1e3


async def ttft_ms(http: httpx.AsyncClient, url: str, text: str) -> float:
    """Time to the first streamed token; the answer is read to its end, as a client does (one that hangs
    up after its first token makes the router close its connection to the replica, and the next request
    opens a new one)."""
    body = {"prompt": text, "max_tokens": 2, "stream": True, "ignore_eos": True}
    ttft = None
    t0 = time.perf_counter()
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = (time.perf_counter() - t0) * 1e3
    if ttft is None:
        raise RuntimeError("no token")
    return ttft


async def router_overhead(router_url: str, replica_url: str, n: int) -> float:
    via, direct = [], []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for i in range(n):
            text = f"overhead probe {i} " * 4
            (via if i % 2 else direct).append(await ttft_ms(http, router_url if i % 2 else replica_url, text))
    return statistics.median(via[5:]) - statistics.median(direct[5:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="prefill must cost something for hits to matter")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--prefixes", type=int, default=12)
    p.add_argument("--prefix-tokens", type=int, default=768)
    p.add_argument("--kv-blocks", type=int, default=320, help="per replica (the single engine gets 3x)")
    p.add_argument("--overhead-requests", type=int, default=200)
    args = p.parse_args()
    load_before = os.getloadavg()
    logs = Path(tempfile.mkdtemp(prefix="stepscope-routing-"))
    texts = prompts(args.requests, args.prefixes, args.prefix_tokens)
    common = ("--num-threads", "1", "--max-num-seqs", "8")
    out: dict[str, float] = {}
    runs = (
        ("single_instance", ("--num-kv-blocks", str(3 * args.kv_blocks))),
        (
            "prefix_aware",
            ("--replicas", "3", "--routing", "prefix_aware", "--num-kv-blocks", str(args.kv_blocks)),
        ),
        (
            "round_robin",
            ("--replicas", "3", "--routing", "round_robin", "--num-kv-blocks", str(args.kv_blocks)),
        ),
    )
    rps = {}
    for name, options in runs:
        proc, url = serve(logs / f"{name}.log", args.model, *common, *options)
        try:
            fig = asyncio.run(closed_loop(url, texts, args.clients))
        finally:
            proc.stop()
        out[f"{name}_cached_share"] = round(fig["cached_share"], 3)
        rps[name] = fig["rps"]
        print(f"{name}: {fig['rps']:.2f} requests/s, cached share {fig['cached_share']:.1%}", file=sys.stderr)
    out["tput_ratio"] = round(rps["prefix_aware"] / rps["round_robin"], 3)
    p50, p99 = route_us()
    out["route_p50_us_64"], out["route_p99_us_64"] = round(p50, 1), round(p99, 1)  # P99: the machine's load
    proc, url = serve(logs / "overhead.log", args.model, *common, "--replicas", "1")
    try:
        replica = httpx.get(url + "/health", trust_env=False).json()["replicas"][0]["url"]
        out["router_ttft_p50_overhead_ms"] = round(
            asyncio.run(router_overhead(url, replica, args.overhead_requests)), 3
        )
    finally:
        proc.stop()
    o = out
    print(
        f"prefix_aware caches {o['prefix_aware_cached_share']:.0%} (one engine "
        f"{o['single_instance_cached_share']:.0%}, round_robin {o['round_robin_cached_share']:.0%}), "
        f"{o['tput_ratio']:.2f}x round_robin's throughput; a decision among 64 replicas P99 "
        f"{o['route_p99_us_64']:.0f} us; router +{o['router_ttft_p50_overhead_ms']:.2f} ms P50 TTFT"
    )
    print(f"wrote {results.write('routing', out, vars(args), load_before)}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
