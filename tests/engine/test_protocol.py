"""The RPC codec: every message survives a round trip; the stream framing copes with any split."""

from __future__ import annotations

import socket

import pytest

from engine.config import SamplingParams
from engine.protocol import (
    Abort,
    Add,
    AdminGet,
    AdminReply,
    AdminSet,
    EngineStats,
    Error,
    FrameBuffer,
    Outputs,
    ProtocolError,
    Ready,
    Shutdown,
    SlowCodec,
    frame,
    get_codec,
)
from engine.request import EngineRequest, RequestOutput, RequestTimings

MESSAGES = [
    Add(
        EngineRequest(
            "cmpl-ü1",
            [0, 1, 2**31 - 1, 257],
            SamplingParams(7, 0.7, 0.9, 40, seed=-3, ignore_eos=True, stop_token_ids=(5, 9)),
            arrival_ns=123_456_789_012,
            cache_salt="tenant-a",
            trace_context="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
    ),
    Add(EngineRequest("r", [42], SamplingParams())),  # seed None, defaults
    Abort(["a", "b-ß"]),
    Abort([]),
    Outputs(
        [
            RequestOutput("a", [1, 2, 3]),
            RequestOutput(
                "b",
                [],
                finished=True,
                finish_reason="length",
                num_prompt_tokens=17,
                num_cached_tokens=16,
                num_preemptions=2,
                timings=RequestTimings(1, 2, 3, 4, 5),
            ),
        ],
        EngineStats(3, 4, 10, 100, 0.1, 640, 320, 7, 1, 37),
    ),
    Outputs([], EngineStats()),
    AdminGet(7),
    AdminSet(8, {"max_num_seqs": 4, "enable_chunked_prefill": False}),
    AdminReply(8, True, {"max_num_seqs": 4}),
    AdminReply(9, False, {"error": "not a runtime knob: x"}),
    Error("r1", "prompt of 5000 tokens does not fit"),
    Error("", "engine core failed: boom"),
    Ready({"model": "tiny", "max_model_len": 2048, "eos_token_id": 257, "block_size": 16}),
    Shutdown(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    codec = get_codec("binary")
    assert codec.decode(codec.encode(msg)) == msg


def test_slow_codec_speaks_the_same_wire_format():
    fast, slow = get_codec("binary"), get_codec("slow:3")
    assert isinstance(slow, SlowCodec) and slow.factor == 3
    for msg in MESSAGES:
        assert slow.encode(msg) == fast.encode(msg)
        assert slow.decode(fast.encode(msg)) == msg


def test_unknown_codec_name_is_rejected():
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("pickle")


def test_tokens_are_packed_not_pickled():
    # 1000 token ids cost 4 bytes each plus a small fixed header: no per-token object overhead
    body = get_codec().encode(Outputs([RequestOutput("x", list(range(1000)))], EngineStats()))
    assert len(body) < 4000 + 200


def test_frame_buffer_reassembles_frames_split_anywhere():
    codec = get_codec()
    stream = b"".join(frame(codec.encode(m)) for m in MESSAGES)
    for chunk in (1, 3, 7, 64, len(stream)):
        buf = FrameBuffer()
        got = []
        for i in range(0, len(stream), chunk):
            got += [codec.decode(b) for b in buf.feed(stream[i : i + chunk])]
        assert got == MESSAGES


def test_frames_cross_a_real_socket_pair():
    codec = get_codec()
    a, b = socket.socketpair()
    with a, b:
        big = Outputs([RequestOutput(f"r{i}", list(range(i))) for i in range(300)], EngineStats(running=300))
        a.sendall(frame(codec.encode(big)) + frame(codec.encode(Shutdown())))
        buf, got = FrameBuffer(), []
        while len(got) < 2:
            got += [codec.decode(body) for body in buf.feed(b.recv(65536))]
    assert got == [big, Shutdown()]


def test_corrupt_frames_raise_protocol_error():
    codec = get_codec()
    with pytest.raises(ProtocolError):
        codec.decode(b"\xff")  # unknown kind
    with pytest.raises(ProtocolError):
        codec.decode(codec.encode(Error("a", "b"))[:-1])  # truncated
    with pytest.raises(ProtocolError):
        codec.decode(codec.encode(Shutdown()) + b"x")  # trailing bytes
    with pytest.raises(ProtocolError):
        FrameBuffer().feed(b"\xff\xff\xff\xff")  # absurd length
    with pytest.raises(ProtocolError):
        codec.encode("not a message")
