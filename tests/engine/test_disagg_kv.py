"""The disaggregation building blocks in one process: prefill-only handoff, KV frames, remote commit."""

from __future__ import annotations

import time

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.disagg import handoff as H
from engine.disagg.kv_link import KVReceiver, KVSender
from engine.disagg.kv_wire import (
    BlocksFrame,
    DoneFrame,
    KVWireError,
    decode_frame,
    encode_blocks,
    encode_done,
    num_tensor_bytes,
)
from engine.request import EngineRequest
from tests.support.net import free_port

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPT = list(range(1, 71))  # 70 tokens: four full blocks of 16 and a partial one


def _core(kv_dtype: str = "auto") -> EngineCore:
    config = EngineConfig(model="tiny", num_kv_blocks=48, max_num_batched_tokens=32, kv_dtype=kv_dtype)
    return EngineCore(config)


def _colocated(kv_dtype: str) -> list[int]:
    core = _core(kv_dtype)
    core.add_request(EngineRequest("r", PROMPT, GREEDY))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    return tokens


def _frame_roundtrip(buffers: list) -> BlocksFrame | DoneFrame:
    data = b"".join(bytes(b) for b in buffers)
    assert int.from_bytes(data[:4], "little") == len(data) - 4
    return decode_frame(bytearray(data[4:]))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_prefill_hands_off_block_by_block_and_decode_continues_to_the_colocated_tokens(kv_dtype):
    prefill, decode = _core(kv_dtype), _core(kv_dtype)
    H.add_prefill_only(prefill, EngineRequest("r", PROMPT, GREEDY))
    assert H.reserve_remote(decode, EngineRequest("r", PROMPT, GREEDY)) is not None
    sent, frames, first = 0, 0, None
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            assert out.finish_reason == "handoff" and out.finished
            first = out.new_token_ids[0]
        seq = H.prefill_sequences(prefill)["r"]
        n = H.num_sendable_blocks(seq, prefill.config.block_size)
        if n > sent:  # chunked prefill: blocks go out as they become final, not all at the end
            frame = _frame_roundtrip(encode_blocks("r", sent, H.read_kv(prefill, seq, sent, n)))
            H.write_remote_kv(decode, "r", frame.first_block, frame.blocks)
            sent, frames = n, frames + 1
        prefill.check_invariants()
        decode.check_invariants()
    assert frames >= 3 and sent == 5
    assert prefill.kv.num_free_blocks < 48  # handed off: blocks held until the copy is taken
    H.release_handoff(prefill, "r")
    assert prefill.kv.num_free_blocks == 48
    tokens = H.commit_remote(decode, "r", first, 0, 0).new_token_ids
    while decode.has_unfinished_requests():
        tokens += [t for out in decode.step() for t in out.new_token_ids]
    decode.check_invariants()
    assert tokens == _colocated(kv_dtype)
    assert decode.kv.num_free_blocks == 48


def test_int8_kv_travels_as_int8_values_and_scales():
    core = _core("int8")
    H.add_prefill_only(core, EngineRequest("r", PROMPT, GREEDY))
    while core.has_unfinished_requests():
        core.step()
    blocks = H.read_kv(core, core.scheduler.handed_off["r"], 0, 5)
    assert [p.dtype for p in blocks[0]] == [torch.int8, torch.bfloat16]
    frame = _frame_roundtrip(encode_blocks("r", 0, blocks))
    pairs = [(a, b) for la, lb in zip(blocks, frame.blocks, strict=True) for a, b in zip(la, lb, strict=True)]
    assert all(torch.equal(a, b) for a, b in pairs)


def test_aborting_a_reserved_or_handed_off_request_frees_its_blocks():
    core = _core()
    assert H.reserve_remote(core, EngineRequest("d", PROMPT, GREEDY)) is not None
    H.add_prefill_only(core, EngineRequest("p", PROMPT, GREEDY))
    while core.has_unfinished_requests():
        core.step()
    assert "p" in core.scheduler.handed_off and "d" in core.scheduler.remote
    core.check_invariants()
    core.abort_request("p")
    core.abort_request("d")
    core.step()
    core.check_invariants()
    assert core.kv.num_free_blocks == 48


def test_a_reservation_waits_for_room_and_a_prompt_too_large_is_refused():
    core = EngineCore(EngineConfig(model="tiny", num_kv_blocks=6))
    assert H.reserve_remote(core, EngineRequest("a", PROMPT, GREEDY)) is not None  # 5 of 6 blocks
    assert H.reserve_remote(core, EngineRequest("b", PROMPT, GREEDY)) is None
    with pytest.raises(ValueError, match="more KV blocks"):
        H.reserve_remote(core, EngineRequest("c", list(range(200)), GREEDY))


def test_kv_frames_refuse_corruption_and_mismatched_caches():
    with pytest.raises(KVWireError):
        decode_frame(bytearray(b"\x09junk"))
    done = DoneFrame("r", 7, 5, 1234, 16, 1, 2)
    assert decode_frame(bytearray(encode_done(done)[4:])) == done
    plain, int8 = _core(), _core("int8")
    H.add_prefill_only(plain, EngineRequest("r", PROMPT, GREEDY))
    while plain.has_unfinished_requests():
        plain.step()
    H.reserve_remote(int8, EngineRequest("r", PROMPT, GREEDY))
    blocks = H.read_kv(plain, plain.scheduler.handed_off["r"], 0, 5)
    with pytest.raises(KVWireError, match="int8 on one side"):
        H.write_remote_kv(int8, "r", 0, blocks)


def test_the_link_delivers_every_byte_sent_and_the_token_bucket_paces_it():
    core = _core()
    H.add_prefill_only(core, EngineRequest("r", PROMPT, GREEDY))
    while core.has_unfinished_requests():
        core.step()
    blocks = H.read_kv(core, core.scheduler.handed_off["r"], 0, 5)
    receiver, done = KVReceiver(), []
    sender = KVSender(done.append)
    sender.bucket.set_mbps(2.0)  # 2 MB/s: ~10 KB here, a few milliseconds; pacing only, not timed
    sender.begin("r", receiver.address, "")
    sender.send_blocks("r", 0, blocks)
    sender.send_done(DoneFrame("r", 1, 5, num_tensor_bytes(blocks), 0, 0, 0))
    deadline = time.monotonic() + 10
    got = []
    while len(got) < 2 and time.monotonic() < deadline:
        got += receiver.drain()
        time.sleep(0.01)
    sender.close()
    receiver.close()
    assert [type(r.frame) for r in got] == [BlocksFrame, DoneFrame]
    assert done[0].kv_bytes == receiver.kv_bytes_received == num_tensor_bytes(blocks) > 0
    assert done[0].num_blocks == 5 and not done[0].error


def test_a_sender_whose_peer_is_gone_reports_a_failed_transfer():
    port = free_port()  # nobody listens here
    done = []
    sender = KVSender(done.append, send_timeout_s=2)
    sender.begin("r", f"127.0.0.1:{port}", "")
    sender.send_done(DoneFrame("r", 1, 0, 0, 0, 0, 0))
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.close()
    assert done and "failed" in done[0].error and sender.transfers_failed == 1
