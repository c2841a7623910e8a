"""Fixtures: a real `stepscope collector` process on a free loopback port, and helpers to talk to it."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from stepscope.procs import Proc, free_port


class Collector(Proc):
    """A running collector process."""

    def __init__(self, args: list[str], log: Path, url: str, token: str | None) -> None:
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

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        return super().stop(sig, timeout_s)  # a graceful stop drains the spool: give it time


@pytest.fixture
def start_collector(tmp_path: Path) -> Iterator[Callable[..., Collector]]:
    """Start `stepscope collector` with the given extra arguments (default store: chdb in tmp_path)."""
    started: list[Collector] = []

    def start(
        *extra: str, store: str | None = None, token: str | None = None, port: int | None = None
    ) -> Collector:
        port = port or free_port()
        log = tmp_path / f"collector-{port}-{len(started)}.log"
        args = ["collector", "--store", store or f"chdb://{tmp_path / 'data'}", "--port", str(port)]
        if token:
            args += ["--token", token]
        c = Collector([*args, *extra], log, f"http://127.0.0.1:{port}", token)
        started.append(c)
        try:
            c.wait_http(f"{c.url}/health", 60)
        except RuntimeError as e:
            raise AssertionError(f"collector did not start: {e}") from None
        return c

    yield start
    for c in started:
        c.stop(signal.SIGKILL)
