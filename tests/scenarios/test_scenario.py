"""The scenario runner: faults map onto real knobs, shifts apply from the onset, truth.json end to end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadgen.workloads import WorkloadShift
from scenarios.calibrate import steady_rate
from scenarios.config import ScenarioConfig, load_specs, workloads
from scenarios.faults import FAULTS, parse_fault
from scenarios.runner import run_scenario

ONSET_S = 10.0


def _shifted(fault: str, value: float):
    return workloads(3, (WorkloadShift(ONSET_S, **FAULTS[fault].shift(value)),))


def test_prefix_cache_miss_changes_the_shared_system_prompt_only_from_the_onset():
    healthy, shifted = workloads(3)[1], _shifted("prefix_cache_miss", 0.9)[1]
    before = [shifted.request(i, ONSET_S - 0.01) for i in range(200)]
    after = [shifted.request(i, ONSET_S) for i in range(200)]
    assert not any(r.prefix_changed for r in before)
    assert [r.messages for r in before] == [healthy.request(i, 0).messages for i in range(200)]
    changed = [r for r in after if r.prefix_changed]
    assert 0.8 < len(changed) / len(after) < 1.0
    system = healthy.request(0).messages[0]["content"]
    assert all(r.messages[0]["content"] != system for r in changed)


def test_long_prompts_scale_prompt_lengths_from_the_onset():
    mixed = _shifted("long_prompts", 3.0)[0]
    before = sum(mixed.request(i, 0.0).prompt_tokens_est for i in range(100))
    after = sum(mixed.request(i, ONSET_S + 1).prompt_tokens_est for i in range(100))
    assert 2.5 < after / before <= 3.0  # the cap clips a few


def test_overload_raises_the_arrival_rate_from_the_onset():
    mixed = _shifted("overload", 3.0)[0]
    assert mixed.rate_changes() == [(ONSET_S, 3.0)]


def test_config_and_engine_faults_map_onto_admin_knobs():
    assert FAULTS["kv_cache_pressure"].limits(0.1, {"num_kv_blocks": 768}) == {"num_kv_blocks": 76}
    assert FAULTS["oversized_batch"].limits(48, {}) == {"max_num_seqs": 48}
    assert FAULTS["prefill_interference"].limits(0, {}) == {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 4096,
    }
    assert FAULTS["scheduler_stall"].engine(50) == {"scheduler_stall_ms": 50.0}
    assert FAULTS["rpc_overhead"].engine(8) == {"rpc_codec": "slow:8"}


@pytest.mark.parametrize(
    "text,message",
    [("nope", "unknown fault"), ("overload=x", "expected a number"), ("kv_cache_pressure=2", "out of range"),
     ("prefill_interference=3", "takes no value")],
)  # fmt: skip
def test_bad_fault_specs_are_refused(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_fault(text)
    assert parse_fault("overload") == ("overload", FAULTS["overload"].default)


def test_scenario_cli_refuses_bad_input_with_exit_2(tmp_path: Path):
    for extra in (
        ["--fault", "nope"], ["--duration", "x"], ["--onset", "90", "--duration", "60"],
        ["--onset-fraction", "1.5"], ["--workload-of", "nope"],
        ["--fault", "overload", "--workload-of", "overload"],
    ):  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "stepscope", "scenario", "run", "--out", str(tmp_path / "r"), *extra],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1


def test_faults_bring_the_workload_and_demand_they_need_to_show():
    # prefix_cache_miss: a long shared system prompt, so that a miss costs real prefill
    default, long_prefix = workloads(3)[1], workloads(3, (), FAULTS["prefix_cache_miss"].workload)[1]
    assert len(long_prefix.system_prompt) > 2 * len(default.system_prompt)
    # oversized_batch: closed-loop clients beyond the old cap of 8, so requests queue at it
    cfg = ScenarioConfig(out=Path("/nonexistent"), fault="oversized_batch", value=48)
    specs = load_specs(None, cfg)
    assert all(s.rate is None for s in specs) and sum(s.concurrency for s in specs) > cfg.max_num_seqs
    assert all(s.rate is not None for s in load_specs(1.0, ScenarioConfig(out=Path("/nonexistent"))))
    # prefill_interference: chunking off with a budget that fits a whole prompt, as vLLM requires
    limits = FAULTS["prefill_interference"].limits(0.0, {})
    assert limits["enable_chunked_prefill"] is False and limits["max_num_batched_tokens"] >= 2048
    # kv_cache_pressure: the pool cut below a full batch of 8, above the longest prompt (65 blocks)
    kv = FAULTS["kv_cache_pressure"]
    blocks = [kv.limits(v, {"num_kv_blocks": 768})["num_kv_blocks"] for v in (kv.default, *kv.magnitudes)]
    assert all(65 < b < 160 for b in blocks)


def test_a_short_scenario_writes_truth_and_stores_the_run(tmp_path: Path):
    out = tmp_path / "run"
    cfg = ScenarioConfig(
        out=out, fault="rpc_overhead", value=4, duration_s=6, onset_s=3, model="tiny", rate=3.0,
        drain_timeout_s=10, log=lambda s: None,
    )  # fmt: skip
    truth = run_scenario(cfg)
    on_disk = json.loads((out / "truth.json").read_text())
    assert on_disk == json.loads(json.dumps(truth))
    assert on_disk["fault"] == "rpc_overhead" and on_disk["value"] == 4
    assert on_disk["start"] < on_disk["onset"] < on_disk["end"]
    assert on_disk["seed"] == 0 and on_disk["model"] == "tiny" and on_disk["load"]["rate_rps"] == 3.0
    assert on_disk["requests_stored"] > 0
    facts = subprocess.run(
        [sys.executable, "-m", "stepscope", "scenario", "facts", str(out)], capture_output=True, text=True
    )
    assert facts.returncode == 0, facts.stderr
    after = json.loads(facts.stdout)["after"]
    assert after["requests"] > 0 and after["steps"] > 0
    assert after["rpc_delay_mean"] is not None  # the front end's measure reached the requests table


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_process_the_scenario_started(tmp_path: Path, sig: int):
    cmd = [sys.executable, "-m", "stepscope", "scenario", "run", "--model", "tiny", "--rate", "2"]
    cmd += ["--duration", "60", "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "run" / "server.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "Application startup complete" not in (
        log.read_text() if log.exists() else ""
    ):
        time.sleep(0.2)
    kids = _children(proc.pid)
    assert len(kids) == 2  # the collector and the server
    time.sleep(1.0)  # into the load
    proc.send_signal(sig)
    assert proc.wait(60) == 130
    assert not [k for k in kids if Path(f"/proc/{k}").exists() and "Z" not in _state(k)]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_capacity_probe_counts_completions_after_the_ramp():
    """A closed loop that starts empty completes nothing for a request's latency: the probe's rate is
    taken after its first quarter, so a slow ramp does not read as low capacity."""
    steady = [5.0 + i * 0.25 for i in range(61)]  # 4 requests/s from 5 s to 20 s
    assert steady_rate(steady, 20.0) == pytest.approx(4.0, rel=0.03)
    assert steady_rate([], 20.0) == 0.05  # nothing finished: a floor, never zero


def test_long_outputs_scale_max_tokens_from_the_onset_only():
    healthy, shifted = workloads(3)[0], _shifted("long_outputs", 4.0)[0]
    before = [shifted.request(i, ONSET_S - 0.01).max_tokens for i in range(50)]
    after = [shifted.request(i, ONSET_S).max_tokens for i in range(50)]
    assert before == [healthy.request(i, 0).max_tokens for i in range(50)]
    assert after == [4 * n for n in before]


def test_the_new_faults_turn_their_knobs():
    assert FAULTS["batch_limit_low"].limits(3, {"max_num_seqs": 8}) == {"max_num_seqs": 3}
    assert FAULTS["frontend_cpu"].engine(50000) == {"frontend_cpu": 50000}
    assert FAULTS["cpu_contention"].neighbours(2) == 2


def test_neighbours_are_real_busy_processes_and_stop():
    import os

    from scenarios.procs import start_neighbours, stop_neighbours

    procs = start_neighbours(2)
    try:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        assert all(os.getpgid(p.pid) == p.pid for p in procs), "each in its own session"
    finally:
        stop_neighbours(procs)
    assert procs == []
