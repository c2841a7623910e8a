"""Fixtures: a real `stepscope collector` process on a free loopback port, and helpers to talk to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

FIXTURES = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "otlp"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Collector:
    """A running collector process."""

    proc: subprocess.Popen
    url: str
    log: Path
    token: str | None = None

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

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(60)


@pytest.fixture
def start_collector(tmp_path: Path) -> Iterator[Callable[..., Collector]]:
    """Start `stepscope collector` with the given extra arguments (default store: chdb in tmp_path)."""
    started: list[Collector] = []

    def start(
        *extra: str, store: str | None = None, token: str | None = None, port: int | None = None
    ) -> Collector:
        port = port or free_port()
        log = tmp_path / f"collector-{port}-{len(started)}.log"
        args = [
            "stepscope",
            "collector",
            "--store",
            store or f"chdb://{tmp_path / 'data'}",
            "--port",
            str(port),
        ]
        if token:
            args += ["--token", token]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [*args, *extra], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        c = Collector(proc, f"http://127.0.0.1:{port}", log, token)
        started.append(c)
        for _ in range(240):
            try:
                if httpx.get(f"{c.url}/health", timeout=1).status_code == 200:
                    return c
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                break
            time.sleep(0.25)
        raise AssertionError(f"collector did not start:\n{log.read_text()[-2000:]}")

    yield start
    for c in started:
        c.stop(signal.SIGKILL)
