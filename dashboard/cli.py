"""`stepscope dashboard`: the Streamlit dashboard over a running collector's query API.

    stepscope dashboard --api http://127.0.0.1:4318 [--port 8501] [--token T] [--bench-dir runs/]

Starts `streamlit run dashboard/app.py` as a child process (headless, no usage statistics) and hands it
the settings through the environment (dashboard/config.py); stops it on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

import httpx

from dashboard.config import DashboardConfig
from stepscope.cli import UsageError

APP = Path(__file__).resolve().parent / "app.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for the DashboardConfig fields; defaults come from the dataclass."""
    d = DashboardConfig()
    parser.add_argument("--api", default=d.api, metavar="URL", help=f"the collector's URL (default: {d.api})")
    parser.add_argument(
        "--token",
        default=os.environ.get("STEPSCOPE_TOKEN"),
        metavar="T",
        help="bearer token of a collector started with --token (or $STEPSCOPE_TOKEN)",
    )
    parser.add_argument("--host", default=d.host, help=f"address to listen on (default: {d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"port to listen on (default: {d.port})")
    parser.add_argument(
        "--bench-dir", default=d.bench_dir, metavar="DIR", help="where to look for bench results"
    )
    parser.add_argument("--slo-ttft", default=f"{d.slo_ttft_s:g}s", help="TTFT SLO (default: %(default)s)")
    parser.add_argument(
        "--slo-tpot", default=f"{d.slo_tpot_s * 1000:g}ms", help="TPOT SLO (default: %(default)s)"
    )
    parser.add_argument(
        "--refresh",
        default=f"{d.refresh_s}s",
        help="auto-refresh period when switched on (default: %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> DashboardConfig:
    """The DashboardConfig the flags describe; UsageError for bad values."""
    from loadgen.cli import parse_duration

    try:
        return DashboardConfig(
            api=args.api,
            token=args.token or None,
            host=args.host,
            port=args.port,
            bench_dir=args.bench_dir,
            slo_ttft_s=parse_duration(args.slo_ttft, "--slo-ttft"),
            slo_tpot_s=parse_duration(args.slo_tpot, "--slo-tpot"),
            refresh_s=max(1, round(parse_duration(args.refresh, "--refresh"))),
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def streamlit_command(cfg: DashboardConfig) -> list[str]:
    """The `streamlit run` command line for this config."""
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.headless", "true",
        "--server.address", cfg.host,
        "--server.port", str(cfg.port),
        "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "minimal",
    ]  # fmt: skip


def _probe(cfg: DashboardConfig) -> str:
    try:
        r = httpx.get(cfg.api + "/health", timeout=5)
    except httpx.HTTPError as e:
        return f"not reachable yet ({type(e).__name__}); the pages will say so until it is"
    return "up" if r.status_code == 200 else f"answered {r.status_code} to /health"


def run(args: argparse.Namespace) -> int:
    """Start Streamlit and wait for it; its exit code is ours."""
    cfg = config_from_args(args)
    print(f"stepscope dashboard: http://{cfg.host}:{cfg.port}  (collector API {cfg.api}: {_probe(cfg)})")
    env = {**os.environ, **cfg.to_env(), "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    proc = subprocess.Popen(streamlit_command(cfg), env=env)

    def forward(signum: int, _frame: FrameType | None) -> None:
        proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
