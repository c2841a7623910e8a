"""A fleet's replicas as the scenario runner targets them, and the faults that act on a replica's processes
rather than through an API: a replica killed mid-run (`replica_down`) and a replica held to a share of the
CPU (`replica_slow`). Real losses of capacity; nothing here writes a span.

    ids = replica_ids(url)                      # the router's replicas, in order, with their pids
    kill_replica(ids[k])                        # SIGKILL replica k's server (its core dies with it)
    throttle = Throttle(tree(ids[k]["pid"]), 3.0).start()   # replica k runs a third of the time
    throttle.stop()                             # and runs freely again
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx

# The throttle's period: a step of the small models takes 5-30 ms on a CPU, so every step is cut at least
# once, as a CFS quota period cuts a container's (100 ms by default, 10 ms in latency-tuned clusters).
THROTTLE_PERIOD_S = 0.01


def replica_ids(url: str) -> list[dict[str, object]]:
    """The router's replicas in order: instance, url, pid, state (GET /health)."""
    r = httpx.get(url + "/health", timeout=10, trust_env=False)
    replicas = r.json().get("replicas")
    if not replicas:
        raise RuntimeError(f"{url} is not a fleet router (no replicas in /health)")
    return replicas


def kill_replica(replica: dict[str, object]) -> None:
    """SIGKILL the replica's server process; its core process follows (parent-death signal)."""
    os.kill(int(replica["pid"]), signal.SIGKILL)


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (read from /proc; a replica is its server and its core process)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the command may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class Throttle:
    """Hold processes to 1/`factor` of the time: stopped (SIGSTOP) for the rest of every period and resumed
    (SIGCONT), as `cpulimit` does and as a CPU quota does to a container that wants more than its share.
    Their work takes ~`factor` times as long in wall time at the same CPU time; the cores they leave are
    free for everyone else. `stop()` resumes them for good (also when they are gone)."""

    def __init__(self, pids: list[int], factor: float, period_s: float = THROTTLE_PERIOD_S) -> None:
        if not factor > 1:
            raise ValueError(f"a throttle needs a factor above 1, got {factor}")
        self.pids, self.run_s, self.period_s = pids, period_s / factor, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="replica-throttle", daemon=True)

    def start(self) -> Throttle:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _loop(self) -> None:
        next_t = time.monotonic()
        try:
            while not self._stop.is_set():
                self._signal(signal.SIGCONT)
                time.sleep(max(0.0, next_t + self.run_s - time.monotonic()))
                self._signal(signal.SIGSTOP)
                next_t += self.period_s
                time.sleep(max(0.0, next_t - time.monotonic()))
                next_t = max(next_t, time.monotonic() - self.period_s)  # never catch up a burst
        finally:
            self._signal(signal.SIGCONT)
