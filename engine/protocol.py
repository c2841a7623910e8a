"""The RPC channel between the HTTP front end and the engine core process.

A byte stream (one end of a Unix socket pair) carries length-prefixed frames:

    +---------------+-----------+------------------------------+
    | u32 LE length | u8 kind   | payload (length - 1 bytes)   |
    +---------------+-----------+------------------------------+

`length` counts the kind byte and the payload. Payloads are struct-packed: integers and floats
little-endian, strings as u32 length + UTF-8, token ids as u32 count + packed int32. Nothing is
pickled: a step's OUTPUTS frame costs a few struct calls per request. The rare admin and READY
messages carry JSON.

A `Codec` turns messages into frame bodies and back; `get_codec(name)` picks one, so a slower
codec can be swapped in without touching either process ("slow:K" repeats the work K times).
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import SamplingParams
from engine.request import EngineRequest, RequestOutput, RequestTimings

MAX_FRAME_BYTES = 256 * 2**20  # a longer length prefix means a corrupt stream, not a real message
_LEN = struct.Struct("<I")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_SAMPLING = struct.Struct("<iddiqBB")  # max_tokens, temperature, top_p, top_k, seed, has_seed, ignore_eos
_OUTPUT = struct.Struct("<Biii5q")  # finished, prompt, cached, preemptions, 5 timings
_STATS = struct.Struct("<iiiidqqqqi")

if array("i").itemsize != 4:  # pragma: no cover - every platform Python supports today
    raise ImportError("array('i') is not 32-bit here; the codec needs int32 token ids")


class ProtocolError(Exception):
    """A frame that does not decode: a bug or a corrupt stream; the channel cannot continue."""


# -- messages ------------------------------------------------------------------------------------
@dataclass(slots=True)
class EngineStats:
    """The core's counters after a step; the front end turns them into gauges and counters."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    preemptions_total: int = 0
    events_dropped: int = 0
    step_tokens: int = 0  # tokens the step this record follows scheduled (0: it follows no step)

    @classmethod
    def from_core(cls, stats: dict[str, float | int]) -> EngineStats:
        """From `EngineCore.stats()`; keys the front end does not use are left out."""
        return cls(**{k: stats[k] for k in cls.__slots__ if k in stats})


@dataclass(slots=True)
class Add:
    request: EngineRequest


@dataclass(slots=True)
class Abort:
    req_ids: list[str]


@dataclass(slots=True)
class Outputs:
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass(slots=True)
class AdminGet:
    seq: int  # echoed in the reply, so replies match their requests


@dataclass(slots=True)
class AdminSet:
    seq: int
    changes: dict[str, object]


@dataclass(slots=True)
class FaultSet:
    """Switch the engine-side faults (engine/faults.py); answered with an AdminReply."""

    seq: int
    settings: dict[str, object]


@dataclass(slots=True)
class AdminReply:
    seq: int
    ok: bool
    payload: dict[str, object]  # the limits when ok, else {"error": message}


@dataclass(slots=True)
class Error:
    req_id: str  # "" for an error of the core itself (e.g. it failed to start)
    message: str


@dataclass(slots=True)
class Ready:
    info: dict[str, object] = field(default_factory=dict)  # model name, max_model_len, vocab, eos, ...


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class Handoff:
    """Disaggregated serving (docs/disagg.md), router -> prefill worker: prefill `request` and stream its
    KV cache to the decode worker listening at `kv_addr` ("host:port")."""

    request: EngineRequest
    kv_addr: str


@dataclass(slots=True)
class WorkerStats:
    """Disaggregated serving, worker -> router, about every half second: load and KV-transfer counters."""

    stats: dict[str, object]


Message = (
    Add | Abort | Outputs | AdminGet | AdminSet | AdminReply | Error | Ready | Shutdown | FaultSet | Handoff
    | WorkerStats
)  # fmt: skip


# -- primitive writers and readers ---------------------------------------------------------------
def _put_str(buf: bytearray, s: str) -> None:
    b = s.encode()
    buf += _U32.pack(len(b))
    buf += b


def _put_ids(buf: bytearray, ids: list[int] | tuple[int, ...]) -> None:
    buf += _U32.pack(len(ids))
    buf += array("i", ids).tobytes()


def _put_json(buf: bytearray, obj: object) -> None:
    _put_str(buf, json.dumps(obj, separators=(",", ":")))


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise ProtocolError(f"frame truncated: wanted {n} bytes at {self.pos} of {len(self.data)}")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def unpack(self, st: struct.Struct) -> tuple:
        return st.unpack(self.take(st.size))

    def u32(self) -> int:
        return self.unpack(_U32)[0]

    def str(self) -> str:
        return str(self.take(self.u32()), "utf-8")

    def ids(self) -> list[int]:
        n = self.u32()
        a = array("i")
        a.frombytes(self.take(4 * n))
        return a.tolist()

    def json(self) -> object:
        return json.loads(self.str())

    def done(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{len(self.data) - self.pos} trailing bytes in frame")


# -- the codec -----------------------------------------------------------------------------------
class Codec:
    """Messages <-> frame bodies (kind byte + payload). The length prefix is `frame()`'s job."""

    name = "binary"

    def encode(self, msg: Message) -> bytes:
        kind = _KINDS.get(type(msg))
        if kind is None:
            raise ProtocolError(f"not a protocol message: {type(msg).__name__}")
        buf = bytearray((kind,))
        _ENCODERS[kind](buf, msg)
        return bytes(buf)

    def decode(self, body: bytes | memoryview) -> Message:
        if not body:
            raise ProtocolError("empty frame")
        decoder = _DECODERS.get(body[0])
        if decoder is None:
            raise ProtocolError(f"unknown message kind {body[0]}")
        r = _Reader(body)
        r.pos = 1
        try:
            msg = decoder(r)
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise ProtocolError(f"bad {decoder.__name__[5:]} frame: {e}") from e
        r.done()
        return msg


class SlowCodec(Codec):
    """The same wire format, with the encoding and decoding work done `factor` times (fault injection)."""

    def __init__(self, factor: int) -> None:
        if factor < 1:
            raise ValueError("the slow codec's factor must be >= 1")
        self.factor = factor
        self.name = f"slow:{factor}"

    def encode(self, msg: Message) -> bytes:
        for _ in range(self.factor - 1):
            super().encode(msg)
        return super().encode(msg)

    def decode(self, body: bytes | memoryview) -> Message:
        for _ in range(self.factor - 1):
            super().decode(body)
        return super().decode(body)


def get_codec(name: str = "binary") -> Codec:
    """`binary` (the default) or `slow:K` (the binary codec doing its work K times)."""
    if name == "binary":
        return Codec()
    if name.startswith("slow:") and name[5:].isdigit():
        return SlowCodec(int(name[5:]))
    raise ValueError(f"unknown codec {name!r}; choose binary or slow:K")


# -- framing -------------------------------------------------------------------------------------
def frame(body: bytes) -> bytes:
    """Length-prefix one frame body for the stream."""
    return _LEN.pack(len(body)) + body


class FrameBuffer:
    """Splits a byte stream into frame bodies; keeps a partial frame until the rest arrives."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        bodies = []
        pos = 0
        while len(self._buf) - pos >= 4:
            (n,) = _LEN.unpack_from(self._buf, pos)
            if n == 0 or n > MAX_FRAME_BYTES:
                raise ProtocolError(f"bad frame length {n}")
            if len(self._buf) - pos - 4 < n:
                break
            bodies.append(bytes(self._buf[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        del self._buf[:pos]
        return bodies


# -- per-message encoders and decoders -----------------------------------------------------------
def _enc_add(buf: bytearray, m: Add) -> None:
    req, sp = m.request, m.request.sampling
    _put_str(buf, req.req_id)
    _put_ids(buf, req.prompt_token_ids)
    seed = sp.seed if sp.seed is not None else 0
    buf += _SAMPLING.pack(
        sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, seed, sp.seed is not None, sp.ignore_eos
    )
    _put_ids(buf, sp.stop_token_ids)
    buf += _I64.pack(req.arrival_ns)
    _put_str(buf, req.cache_salt)
    _put_str(buf, req.trace_context)


def _dec_add(r: _Reader) -> Add:
    req_id, prompt = r.str(), r.ids()
    max_tokens, temperature, top_p, top_k, seed, has_seed, ignore_eos = r.unpack(_SAMPLING)
    stop_ids = tuple(r.ids())
    sp = SamplingParams(
        max_tokens, temperature, top_p, top_k, seed if has_seed else None, bool(ignore_eos), stop_ids
    )
    (arrival_ns,) = r.unpack(_I64)
    return Add(EngineRequest(req_id, prompt, sp, arrival_ns, cache_salt=r.str(), trace_context=r.str()))


def _enc_abort(buf: bytearray, m: Abort) -> None:
    buf += _U32.pack(len(m.req_ids))
    for req_id in m.req_ids:
        _put_str(buf, req_id)


def _dec_abort(r: _Reader) -> Abort:
    return Abort([r.str() for _ in range(r.u32())])


def _enc_outputs(buf: bytearray, m: Outputs) -> None:
    buf += _STATS.pack(*(getattr(m.stats, name) for name in EngineStats.__slots__))
    buf += _U32.pack(len(m.outputs))
    for o in m.outputs:
        _put_str(buf, o.req_id)
        _put_ids(buf, o.new_token_ids)
        t = o.timings
        buf += _OUTPUT.pack(
            o.finished,
            o.num_prompt_tokens,
            o.num_cached_tokens,
            o.num_preemptions,
            t.arrival_ns,
            t.first_scheduled_ns,
            t.first_token_ns,
            t.last_token_ns,
            t.finished_ns,
        )
        _put_str(buf, o.finish_reason or "")


def _dec_outputs(r: _Reader) -> Outputs:
    stats = EngineStats(*r.unpack(_STATS))
    outputs = []
    for _ in range(r.u32()):
        req_id, ids = r.str(), r.ids()
        finished, prompt, cached, preempt, *times = r.unpack(_OUTPUT)
        reason = r.str() or None
        timings = RequestTimings(*times)
        outputs.append(RequestOutput(req_id, ids, bool(finished), reason, prompt, cached, preempt, timings))
    return Outputs(outputs, stats)


def _enc_admin_get(buf: bytearray, m: AdminGet) -> None:
    buf += _U32.pack(m.seq)


def _dec_admin_get(r: _Reader) -> AdminGet:
    return AdminGet(r.u32())


def _enc_admin_set(buf: bytearray, m: AdminSet) -> None:
    buf += _U32.pack(m.seq)
    _put_json(buf, m.changes)


def _dec_admin_set(r: _Reader) -> AdminSet:
    return AdminSet(r.u32(), _json_object(r))


def _enc_fault_set(buf: bytearray, m: FaultSet) -> None:
    buf += _U32.pack(m.seq)
    _put_json(buf, m.settings)


def _dec_fault_set(r: _Reader) -> FaultSet:
    return FaultSet(r.u32(), _json_object(r))


def _enc_admin_reply(buf: bytearray, m: AdminReply) -> None:
    buf += _U32.pack(m.seq)
    buf.append(1 if m.ok else 0)
    _put_json(buf, m.payload)


def _dec_admin_reply(r: _Reader) -> AdminReply:
    seq = r.u32()
    ok = bool(r.take(1)[0])
    return AdminReply(seq, ok, _json_object(r))


def _enc_error(buf: bytearray, m: Error) -> None:
    _put_str(buf, m.req_id)
    _put_str(buf, m.message)


def _dec_error(r: _Reader) -> Error:
    return Error(r.str(), r.str())


def _enc_ready(buf: bytearray, m: Ready) -> None:
    _put_json(buf, m.info)


def _dec_ready(r: _Reader) -> Ready:
    return Ready(_json_object(r))


def _enc_handoff(buf: bytearray, m: Handoff) -> None:
    _enc_add(buf, Add(m.request))
    _put_str(buf, m.kv_addr)


def _dec_handoff(r: _Reader) -> Handoff:
    return Handoff(_dec_add(r).request, r.str())


def _enc_worker_stats(buf: bytearray, m: WorkerStats) -> None:
    _put_json(buf, m.stats)


def _dec_worker_stats(r: _Reader) -> WorkerStats:
    return WorkerStats(_json_object(r))


def _enc_shutdown(buf: bytearray, m: Shutdown) -> None:
    pass


def _dec_shutdown(r: _Reader) -> Shutdown:
    return Shutdown()


def _json_object(r: _Reader) -> dict[str, object]:
    obj = r.json()
    if not isinstance(obj, dict):
        raise ProtocolError("expected a JSON object")
    return obj


# The wire kind of a message is its position here, from 1: append new kinds, never reorder.
_TABLE: list[tuple[type, Callable[[bytearray, Any], None], Callable[[_Reader], Message]]] = [
    (Add, _enc_add, _dec_add),
    (Abort, _enc_abort, _dec_abort),
    (Outputs, _enc_outputs, _dec_outputs),
    (AdminGet, _enc_admin_get, _dec_admin_get),
    (AdminSet, _enc_admin_set, _dec_admin_set),
    (AdminReply, _enc_admin_reply, _dec_admin_reply),
    (Error, _enc_error, _dec_error),
    (Ready, _enc_ready, _dec_ready),
    (Shutdown, _enc_shutdown, _dec_shutdown),
    (FaultSet, _enc_fault_set, _dec_fault_set),
    (Handoff, _enc_handoff, _dec_handoff),
    (WorkerStats, _enc_worker_stats, _dec_worker_stats),
]
_KINDS = {cls: kind for kind, (cls, _, _) in enumerate(_TABLE, 1)}
_ENCODERS = {kind: enc for kind, (_, enc, _) in enumerate(_TABLE, 1)}
_DECODERS = {kind: dec for kind, (_, _, dec) in enumerate(_TABLE, 1)}
