"""Engine-side faults change the real system: a contended step lock, a costlier codec, a guarded admin API."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.core_proc import Channel, CoreLoop
from engine.events import StepEvent
from engine.faults import EngineFaults, FaultSettings
from engine.protocol import Add, AdminReply, EngineStats, FaultSet, Outputs, Shutdown, get_codec
from engine.request import EngineRequest, RequestOutput, RequestTimings
from tests.engine.test_server import ADMIN_TOKEN, Server

STALL_MS = 60


def _run_loop(faults: EngineFaults, fault_settings: dict | None) -> tuple[list[StepEvent], Channel, CoreLoop]:
    """Run 4 long requests through a real CoreLoop in a thread; return its step events."""
    events: list[StepEvent] = []
    core = EngineCore(EngineConfig(model="tiny", num_threads=1, num_kv_blocks=256), record_events=True)
    ours, theirs = socket.socketpair()
    loop = CoreLoop(core, Channel(theirs, get_codec()), lambda evs: events.extend(evs), faults)
    thread = threading.Thread(target=loop.run)
    thread.start()
    front = Channel(ours, get_codec())
    replies: list[AdminReply] = []
    if fault_settings is not None:
        front.send(FaultSet(1, fault_settings))
    sp = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    for i in range(4):
        front.send(Add(EngineRequest(f"r{i}", [256, 1 + i, 2, 3], sp)))
    finished = 0
    while finished < 4:
        for msg in front.receive(block=True, timeout=30) or []:
            if isinstance(msg, Outputs):
                finished += sum(o.finished for o in msg.outputs)
            elif isinstance(msg, AdminReply):
                replies.append(msg)
    front.send(Shutdown())
    thread.join(30)
    faults.close()
    if fault_settings is not None:
        assert replies and replies[0].ok, replies
    return [e for e in events if isinstance(e, StepEvent)], front, loop


def _gaps_ms(steps: list[StepEvent]) -> list[float]:
    return [(s.start_ns - s.prev_end_ns) / 1e6 for s in steps if s.prev_end_ns]


def test_scheduler_stall_holds_the_step_lock_so_gaps_between_steps_grow():
    healthy, _, _ = _run_loop(EngineFaults(), None)
    faults = EngineFaults(seed=1)
    stalled, _, loop = _run_loop(faults, {"scheduler_stall_ms": STALL_MS})
    assert faults.stall.stalls >= 1  # the thread really took the lock while steps ran
    # a step that wanted the lock while the thread held it waited most of the hold: a real gap
    long_gaps = [g for g in _gaps_ms(stalled) if g >= 0.5 * STALL_MS]
    assert len(long_gaps) >= 1
    assert len(long_gaps) > len([g for g in _gaps_ms(healthy) if g >= 0.5 * STALL_MS])
    assert loop.faults.settings.scheduler_stall_ms == STALL_MS


def test_fault_set_switches_the_core_codec_and_a_bad_one_is_refused():
    faults = EngineFaults()
    _, _, loop = _run_loop(faults, {"rpc_codec": "slow:8"})
    assert loop.channel.codec.name == "slow:8"
    with pytest.raises(ValueError, match="unknown codec"):
        FaultSettings.from_json({"rpc_codec": "fast"})
    with pytest.raises(ValueError, match="unknown fault"):
        FaultSettings.from_json({"scheduler_stall": 5})
    with pytest.raises(ValueError, match="scheduler_stall_ms"):
        FaultSettings(scheduler_stall_ms=-1)


def test_slow_codec_spends_more_cpu_per_frame_with_the_same_bytes():
    timings = RequestTimings(1, 2, 3, 4, 0)
    outs = [RequestOutput(f"req-{i}", [i, i + 1], False, None, 100, 16, 0, timings) for i in range(16)]
    msg = Outputs(outs, EngineStats(running=16, kv_blocks_total=100))
    fast, slow = get_codec("binary"), get_codec("slow:16")
    assert fast.encode(msg) == slow.encode(msg)  # same wire format: each end may switch on its own

    def cpu(codec: object) -> float:
        t = time.process_time()
        for _ in range(200):
            codec.decode(codec.encode(msg))
        return time.process_time() - t

    cpu(fast)  # warm up
    assert cpu(slow) > 4 * cpu(fast)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tmp_path_factory.mktemp("faults") / "server.log", "--admin-token", ADMIN_TOKEN)
    srv.wait_healthy()
    yield srv
    srv.stop()


def test_admin_faults_endpoint_is_token_protected_and_validates(server: Server):
    url = server.url + "/admin/faults"
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert httpx.post(url, json={"scheduler_stall_ms": 10}).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
    bad_bodies = (
        {"scheduler_stall_ms": -5},
        {"rpc_codec": "zstd"},
        {"stall": 1},
        {"scheduler_stall_ms": "x"},
        {"weight_quant_off": True},  # this engine serves no int8 weights
    )
    for bad in bad_bodies:
        r = httpx.post(url, json=bad, headers=auth)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["message"]
    assert httpx.get(url, headers=auth).json() == {
        "scheduler_stall_ms": 0.0,
        "rpc_codec": "binary",
        "kv_transfer_mbps": 0.0,
        "weight_quant_off": False,
        "frontend_cpu": 0,
        "busy_threads": 0,
    }


def test_admin_faults_switch_on_a_live_server_and_requests_still_complete(server: Server):
    url = server.url + "/admin/faults"
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    r = httpx.post(url, json={"scheduler_stall_ms": 20, "rpc_codec": "slow:4"}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "scheduler_stall_ms": 20,
        "rpc_codec": "slow:4",
        "kv_transfer_mbps": 0.0,
        "weight_quant_off": False,
        "frontend_cpu": 0,
        "busy_threads": 0,
    }
    body = {"prompt": "hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 24
    assert httpx.post(url, json={}, headers=auth).json() == {
        "scheduler_stall_ms": 0.0,
        "rpc_codec": "binary",
        "kv_transfer_mbps": 0.0,
        "weight_quant_off": False,
        "frontend_cpu": 0,
        "busy_threads": 0,
    }
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert out.status_code == 200


def test_kv_cache_pressure_preempts_on_a_shrunk_pool_with_prefix_hits_instead_of_crashing():
    # The kv_cache_pressure fault shrinks the pool of a running engine whose requests share a cached
    # system prompt. Admission used to undercount a prefix-hit request's blocks and the pool raised
    # "asked for N blocks with M free" in the step loop (the core died mid-scenario).
    # And blocks still in use when the pool shrank were found again by prefix hits once freed (KeyError).
    core = EngineCore(EngineConfig(model="tiny", num_threads=1, num_kv_blocks=256, block_size=16))
    system = [256 + i for i in range(160)]  # 10 shared blocks
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(8):
        core.add_request(EngineRequest(f"r{i}", system + [7 + i] * 40, sp))
    finished = {o.req_id for _ in range(3) for o in core.step() if o.finished}  # running, prefix cached
    core.update_limits(num_kv_blocks=24)  # 384 tokens: two of these requests do not fit together
    for i in range(8, 12):
        core.add_request(EngineRequest(f"r{i}", system + [7 + i] * 40, sp))
    for _ in range(5000):
        finished |= {o.req_id for o in core.step() if o.finished}
        core.check_invariants()
        if not core.has_unfinished_requests():
            break
    assert finished == {f"r{i}" for i in range(12)}
    assert core.scheduler.num_preemptions_total > 0
