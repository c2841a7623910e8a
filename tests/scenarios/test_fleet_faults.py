"""The process faults of a fleet run act on real processes: `replica_slow`'s throttle stops and resumes a
replica's whole process tree, and leaves it running when taken back."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scenarios.faults import parse_fault
from scenarios.fleet import Throttle, tree

# A process with a child: a replica's server and its core process.
PARENT = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"  # noqa: E501


def state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


@pytest.fixture
def replica() -> Iterator[list[int]]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        wait_for(lambda: len(tree(parent.pid)) == 2, "the child process")
        yield tree(parent.pid)
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_the_throttle_stops_and_resumes_a_replica_and_leaves_it_running(replica: list[int]) -> None:
    parent, child = replica
    assert tree(parent) == [parent, child]
    throttle = Throttle(replica, 4.0).start()
    try:
        for pid in replica:  # each process is seen stopped and seen running again while throttled
            wait_for(lambda pid=pid: state(pid) == "T", f"{pid} stopped")
            wait_for(lambda pid=pid: state(pid) != "T", f"{pid} resumed")
    finally:
        throttle.stop()
    time.sleep(0.05)  # longer than a period: a stop would show
    assert [state(pid) for pid in replica] == ["S", "S"]


def test_replica_slow_takes_a_slowdown_above_one() -> None:
    assert parse_fault("replica_slow") == ("replica_slow", 3.0)
    assert parse_fault("replica_slow=2.5") == ("replica_slow", 2.5)
    with pytest.raises(ValueError, match="above 1"):
        parse_fault("replica_slow=1")
    with pytest.raises(ValueError, match="above 1"):
        Throttle([], 0.5)
