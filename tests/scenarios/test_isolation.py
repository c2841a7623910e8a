"""The scenario harness keeps the engine's step loops on cores of their own (scenarios/procs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scenarios.procs import core_split, pin_engine_cores

needs_two_cores = pytest.mark.skipif(core_split() is None, reason="needs two cores to split")


def test_core_split_gives_the_engine_cores_apart_from_the_harness() -> None:
    split = core_split()
    if split is None:
        assert len(os.sched_getaffinity(0)) < 2
        return
    harness, engine = split
    assert harness and engine and not harness & engine
    assert harness | engine <= set(range(os.cpu_count() or 1))


@needs_two_cores
def test_only_core_processes_under_the_server_move_to_the_engine_cores() -> None:
    # a stand-in server: a process that starts a child whose command line names the core module, as
    # `stepscope serve` starts `python -m engine.core_proc`, and prints the child's pid
    script = textwrap.dedent(
        f"""
        import subprocess, sys, time
        sleeper = [{sys.executable!r}, "-c", "import time; time.sleep(60)", "engine.core_proc"]
        child = subprocess.Popen(sleeper)
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core = int(server.stdout.readline())
        assert pin_engine_cores(server.pid) == [core]
        assert os.sched_getaffinity(core) == core_split()[1]
        assert os.sched_getaffinity(server.pid) == core_split()[0]  # the front end on the harness cores
    finally:
        server.kill()
        server.wait()


@needs_two_cores
def test_a_server_without_a_core_process_keeps_every_core() -> None:
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = os.sched_getaffinity(server.pid)
        assert pin_engine_cores(server.pid) == []
        assert os.sched_getaffinity(server.pid) == before
    finally:
        server.kill()
        server.wait()


@needs_two_cores
def test_the_harness_gets_its_cores_back_after_a_run() -> None:
    from scenarios.procs import isolate_harness

    before = os.sched_getaffinity(0)
    unpin = isolate_harness(True)
    assert os.sched_getaffinity(0) == core_split()[0]
    unpin()
    assert os.sched_getaffinity(0) == before


@needs_two_cores
def test_a_fleet_with_more_replicas_than_engine_cores_shares_every_core(tmp_path) -> None:
    from scenarios.config import ScenarioConfig
    from scenarios.procs import isolates

    engine = len(core_split()[1])
    assert isolates(ScenarioConfig(out=tmp_path))  # one engine: its step loop on a core of its own
    assert isolates(ScenarioConfig(out=tmp_path, replicas=max(2, engine))) == (engine >= 2)
    # replicas that would take turns on the engine cores share them all with the harness instead
    assert not isolates(ScenarioConfig(out=tmp_path, replicas=engine + 1))
    assert not isolates(ScenarioConfig(out=tmp_path, isolate_cores=False))


def test_a_collector_that_shares_the_engines_cores_runs_niced(tmp_path) -> None:
    from scenarios.procs import COLLECTOR_START_S, HARNESS_NICE, harness_nice, launch_collector

    assert harness_nice(False) == HARNESS_NICE > 0  # a fleet that shares every core
    assert harness_nice(True) == 0  # the harness on cores of its own
    store = tmp_path / "store"
    store.mkdir()
    collector, url = launch_collector(store, tmp_path / "collector.log", nice=HARNESS_NICE)
    try:
        collector.wait_http(url + "/health", COLLECTOR_START_S)  # up, its store's threads started
        threads = {int(t): _thread_name(collector.pid, t) for t in os.listdir(f"/proc/{collector.pid}/task")}
        assert len(threads) > 1
        # every thread but those ClickHouse raises itself (its memory-tracking workers, at -20 as root;
        # on a busy machine a second one may be alive at the moment of listing)
        own = [t for t, name in threads.items() if name not in ("MemoryWorker", None)]
        assert collector.pid in own and len(own) >= len(threads) - 2
        assert [t for t in own if _thread_nice(t) not in (HARNESS_NICE, None)] == []
        autogroup = Path(f"/proc/{collector.pid}/autogroup")
        if autogroup.exists():  # "/autogroup-N nice K"
            assert autogroup.read_text().split()[-1] == str(HARNESS_NICE)
    finally:
        collector.stop()


def _thread_name(pid: int, tid: str) -> str | None:
    """A thread's name (`comm`), or None when it ended meanwhile."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return None


def _thread_nice(tid: int) -> int | None:
    """A thread's niceness, or None when it ended meanwhile."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return None
