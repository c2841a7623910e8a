"""Scrape cost: the collector's CPU while it scrapes many engines' /metrics pages.

    python benchmarks/scrape.py [--targets 100] [--interval 5s] [--seconds 60] [--page vllm_v1.txt]

A target server (a process of its own, so its CPU is not counted) serves a recorded vLLM page
(tests/data/scrape/vllm_v1.txt: 243 lines, 135 mapped samples, `_created` series and unmapped families
included) on `--targets` paths; `stepscope collector` is started as a real process on a fresh chDB store
with one `[[scrape]]` entry per path (each its own instance) and `--scrape-interval`. After a warm-up of two
intervals (the first scrape of a page also parses every series through prometheus_client's parser), the
collector's CPU time (user + system, its worker processes included) is read over `--seconds`.

`cpu_share` = collector CPU seconds / wall seconds while scraping (1.0 = one core busy); `idle_cpu_share`
is the same collector with no targets over the same window, run first; `scrape_cpu_share` is the
difference: what scraping costs. `samples_per_s` is the mapped samples stored per second (checked with
count() at the end). The last line is one JSON object; the same goes to
`benchmarks/results/<date>-<commit>-scrape.json` with the CPU model, core count, load average before and
after, and the arguments (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import results  # noqa: E402
from benchmarks.ingest import cpu_seconds  # noqa: E402
from stepscope.procs import free_port  # noqa: E402


def serve(port: int, page: Path) -> None:
    """Serve `page` on every path (the target server process)."""
    body = page.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as an engine's server does

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def start_collector(
    work: Path, name: str, config: Path | None, interval: str
) -> tuple[subprocess.Popen, int]:
    port = free_port()
    args = [sys.executable, "-m", "stepscope", "collector", "--store", f"chdb://{work / name}",
            "--port", str(port), "--log-level", "error", "--scrape-interval", interval]  # fmt: skip
    if config is not None:
        args += ["--config", str(config)]
    log = open(work / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise SystemExit(f"collector did not start: {(work / f'{name}.log').read_text()[-500:]}")


def measure(proc: subprocess.Popen, warmup_s: float, seconds: float) -> float:
    time.sleep(warmup_s)
    c0, t0 = cpu_seconds(proc.pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", type=int, default=100)
    p.add_argument("--interval", default="5s")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--page", default="vllm_v1.txt", help="a file in tests/data/scrape")
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)  # the target server process
    args = p.parse_args()
    page = ROOT / "tests" / "data" / "scrape" / args.page
    if args.serve:
        serve(args.serve, page)
        return 0
    from alerting.rules import parse_duration

    load_before = os.getloadavg()
    interval_s = parse_duration(args.interval)
    work = Path(tempfile.mkdtemp(prefix="stepscope-scrape-bench-"))
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--page", args.page])
    config = work / "collector.toml"
    config.write_text(
        "".join(
            f'[[scrape]]\nurl = "http://127.0.0.1:{port}/t{i}/metrics"\ninstance = "engine-{i}"\n'
            'service = "bench"\n\n'
            for i in range(args.targets)
        )
    )
    try:
        idle, _ = start_collector(work, "idle", None, args.interval)
        try:
            idle_share = measure(idle, 2 * interval_s, args.seconds)
        finally:
            stop(idle)
        busy, busy_port = start_collector(work, "busy", config, args.interval)
        try:
            t_start = time.time()
            share = measure(busy, 2 * interval_s, args.seconds)
            health = httpx.get(f"http://127.0.0.1:{busy_port}/health", timeout=10).json()["scrape"]
            stored = httpx.post(
                f"http://127.0.0.1:{busy_port}/api/sql",
                json={
                    "sql": "SELECT count() FROM engine_samples WHERE metric NOT IN ('up', 'scrape_samples')"
                },
                timeout=60,
            ).json()["rows"][0][0]
            elapsed = time.time() - t_start
        finally:
            stop(busy)
    finally:
        server.terminate()
    up = sum(t["up"] for t in health["targets"])
    result = {
        "targets": args.targets,
        "interval_s": interval_s,
        "cpu_share": round(share, 4),
        "idle_cpu_share": round(idle_share, 4),
        "scrape_cpu_share": round(share - idle_share, 4),
        "targets_up": up,
        "samples_per_s": round(stored / elapsed, 1),
        "seconds": args.seconds,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(
        f"{args.targets} targets every {interval_s:g}s: collector {share:.1%} of a core "
        f"({idle_share:.1%} idle), {up} up, {result['samples_per_s']} samples/s"
    )
    arguments = {k: v for k, v in vars(args).items() if k != "serve"}
    print(f"wrote {results.write('scrape', result, arguments, load_before)}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
