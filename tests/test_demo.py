"""`stepscope demo` end to end, as a newcomer runs it: the real collector (chDB), engine, load, fault, alert
runner and diagnosis, with the tiny model and a fixed rate so that it takes about a minute here.

What must hold: the demo goes through every phase, its diagnosis names the injected cause as the top
finding, it exits 0, and Ctrl-C at any point leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def demo(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stepscope", "demo", "--model", "tiny", "--rate", "6", "--out", str(out)]
    cmd += extra
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[1]), int(fields[3])) if fields[0] != "Z" else None


def descendants(root: int) -> set[int]:
    """Every live process below `root`."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := stat(int(entry))) is not None:
            parents[int(entry)] = s[0]
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def survivors(pids: set[int], sessions: set[int]) -> list[int]:
    """Processes still alive from `pids`, or anywhere in one of `sessions`."""
    alive = {pid for pid in pids if stat(pid) is not None}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := stat(int(entry))) is not None and s[1] in sessions:
            alive.add(int(entry))
    return sorted(alive)


def wait_gone(pids: set[int], sessions: set[int], timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := survivors(pids, sessions)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_demo_runs_every_phase_prints_the_diagnosis_and_exits_0(tmp_path: Path) -> None:
    # 20 s a side: on a busy machine the healthy side's tail is noisy and the first seconds of the fault
    # look like it; the fault's own seconds must outweigh them
    proc = demo(tmp_path / "demo", "--duration", "40", "--no-dashboard")  # a fault that overloads
    children: set[int] = set()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "[3/5]" in line:
            children = descendants(proc.pid)  # the collector and the engine (with its core) are up
    rc = proc.wait(timeout=300)
    out = "".join(lines)
    assert rc == 0, out
    for phase in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"):
        assert phase in out, out
    assert "alert rule armed: TTFT P99 >" in out
    assert "fault on: workload shift {'prefix_change_fraction': 0.9}" in out
    assert "stepscope diagnosis" in out and "injected: prefix_cache_miss" in out
    assert "; top finding: prefix_cache_miss" in out, out
    assert "Ctrl-C stops them" not in out  # --no-dashboard: exits when done
    for name in ("collector.log", "server.log", "rules.toml", "store"):
        assert (tmp_path / "demo" / name).exists(), name
    assert len(children) >= 3
    assert wait_gone(children, children) == []


def test_ctrl_c_stops_every_process_the_demo_started(tmp_path: Path) -> None:
    proc = demo(tmp_path / "demo", "--duration", "120", "--dashboard-port", "0")
    children: set[int] = set()
    try:
        for line in proc.stdout:
            if "[3/5]" in line:  # collector, engine, dashboard (Streamlit) all running, load starting
                children = descendants(proc.pid)
                break
        assert len(children) >= 4, children
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    assert "interrupted: stopping everything the demo started" in rest
    assert wait_gone(children, children) == []


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, message in (
        (["--fault", "nosuch"], "unknown fault"),
        (["--duration", "5"], "--duration must be at least 20"),
        (["--rate", "fast"], "--rate: expected a number"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "stepscope", "demo", "--out", str(tmp_path / "x"), *args],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
