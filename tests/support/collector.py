"""A real `stepscope collector` process on a free loopback port, and how tests talk to it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx

from stepscope.procs import Proc
from tests.support.net import free_port


class Collector(Proc):
    """A running collector: its URL, its bearer token (if any), SQL through its API."""

    def __init__(self, args: list[str], log: Path, url: str, token: str | None = None) -> None:
        super().__init__(args, log)
        self.url, self.token = url, token

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def sql(self, query: str) -> httpx.Response:
        return httpx.post(f"{self.url}/api/sql", json={"sql": query}, headers=self.headers(), timeout=60)

    def scalar(self, query: str) -> object:
        r = self.sql(query)
        assert r.status_code == 200, r.text
        return r.json()["rows"][0][0]

    def wait_count(self, query: str, want: int, timeout_s: float = 60) -> int:
        """Poll a count() until it reaches `want` (acknowledged rows may still be on their way in)."""
        deadline, got = time.monotonic() + timeout_s, -1
        while time.monotonic() < deadline:
            got = int(self.scalar(query))
            if got >= want:
                return got
            time.sleep(0.1)
        return got

    def wait_drained(self, timeout_s: float = 60) -> bool:
        """Poll /health until nothing is spooled: every acknowledged batch is then in the store, in its
        tables and in the views fed from them (one insert fills the table before its views)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.health()["spooled_batches"] == 0:
                return True
            time.sleep(0.1)
        return False

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        return super().stop(sig, timeout_s)  # a graceful stop drains the spool: give it time


def start_collector(
    store: str,
    log: Path,
    *extra: str,
    token: str | None = None,
    port: int | None = None,
    store_up: bool = False,
    timeout_s: float = 120,
) -> Collector:
    """`stepscope collector --store STORE` plus `extra` arguments; returns once /health answers (and, with
    `store_up`, once it reports the store up). A collector that does not start fails the test with its log."""
    port = port or free_port()
    args = [
        "collector",
        "--store",
        store,
        "--port",
        str(port),
        *(["--token", token] if token else []),
        *extra,
    ]
    c = Collector(args, log, f"http://127.0.0.1:{port}", token)
    try:
        c.wait_http(f"{c.url}/health", timeout_s)
        deadline = time.monotonic() + timeout_s
        while store_up and c.health().get("store") != "up":
            if time.monotonic() > deadline or not c.alive():
                raise RuntimeError(f"store not up after {timeout_s:g}s: {c.tail()}")
            time.sleep(0.25)
    except RuntimeError as e:
        c.stop(signal.SIGKILL)
        raise AssertionError(f"collector did not start: {e}") from None
    return c
