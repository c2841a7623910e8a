"""A fleet's replicas as the scenario runner targets them, and the fault that acts on a process rather than
through an API: a replica killed mid-run (`replica_down`). A real loss; nothing here writes a span.

    ids = replica_ids(url)                      # the router's replicas, in order, with their pids
    kill_replica(ids[k])                        # SIGKILL replica k's server (its core dies with it)
"""

from __future__ import annotations

import os
import signal

import httpx


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
