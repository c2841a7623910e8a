"""The processes of a scenario: `stepscope collector` and `stepscope serve` as subprocesses.

Each runs in its own session (so a Ctrl-C in the terminal reaches only the runner, whose `finally` stops
them), logs to a file in the run directory, and is stopped with SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from diagnosis.scenario import ScenarioConfig


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A `stepscope` subprocess in its own session, logging to a file; `stop()` is SIGTERM then SIGKILL."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "stepscope", *args]
        self.log = log
        self.proc = subprocess.Popen(
            cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Until `url` answers 200; RuntimeError (with the log's tail) if the process dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log.name}: exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.log.name}: {url} not up after {timeout_s:g}s: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:]

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        return self.proc.returncode


def start_server(cfg: ScenarioConfig, log: Path, token: str, otlp: str | None) -> tuple[Proc, str]:
    """`stepscope serve` with the scenario's engine; (process, base URL) once healthy."""
    port = free_port()
    args = ["serve", *cfg.engine_args(), "--port", str(port), "--admin-token", token]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if otlp:
        args += ["--otlp-endpoint", otlp, "--trace-steps-every", "1"]
        env |= {"OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_METRIC_EXPORT_INTERVAL": "2000"}
    proc = Proc(args, log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", 300)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def start_collector(store: Path, log: Path) -> tuple[Proc, str]:
    """`stepscope collector` on chDB in `store`; (process, base URL) once healthy."""
    port = free_port()
    proc = Proc(
        ["collector", "--store", f"chdb://{store}", "--port", str(port), "--log-level", "warning"], log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", 120)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def count_rows(collector_url: str, table: str) -> int:
    """Rows in a table, through the collector's read-only SQL API (-1 when it does not answer)."""
    try:
        r = httpx.post(f"{collector_url}/api/sql", json={"sql": f"SELECT count() FROM {table}"}, timeout=10)
        return int(r.json()["rows"][0][0]) if r.status_code == 200 else -1
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return -1


def wait_flushed(collector_url: str, timeout_s: float = 60.0, quiet_s: float = 3.0) -> int:
    """Poll `requests` until its count stops growing for `quiet_s`; returns the count."""
    deadline, last, since = time.monotonic() + timeout_s, -2, time.monotonic()
    while time.monotonic() < deadline:
        n = count_rows(collector_url, "requests")
        if n != last:
            last, since = n, time.monotonic()
        elif n >= 0 and time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.5)
    return last
