"""Child processes for runners, benchmarks and tests: a free loopback port, and a `stepscope` subprocess.

Each child runs in its own session (a Ctrl-C in the terminal reaches only the parent, whose `finally`
stops it, and a stop reaches the child's own children too), logs to a file, and is stopped with
SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STEPSCOPE = [sys.executable, "-m", "stepscope"]


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """`stepscope ARGS` (or `program ARGS`) in its own session, stdout and stderr to `log`."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        *,
        program: list[str] | None = None,
    ) -> None:
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [*(program or STEPSCOPE), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_http(self, url: str, timeout_s: float = 120.0) -> None:
        """Until `url` answers 200; RuntimeError (with the log's tail) if the process dies or times out."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2, trust_env=False) as http:  # one client: each loads the TLS store
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.log.name}: exited {self.proc.returncode}: {self.tail()}")
                try:
                    if http.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"{self.log.name}: {url} not up after {timeout_s:g}s: {self.tail()}")

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def send(self, sig: int) -> None:
        """`sig` to the whole process group (the child and whatever it started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """`sig` (SIGTERM by default), SIGKILL after `timeout_s`; the exit code."""
        if self.proc.poll() is None:
            self.send(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.send(signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
