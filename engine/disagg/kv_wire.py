"""KV blocks out of and into a paged cache, and the frames that carry them from prefill to decode.

A layer's cache is a tensor [2, num_blocks, block_size, Hkv, Dh] or an int8 cache object with `values`
(the same layout in int8) and `scales` [2, num_blocks, block_size, Hkv] (engine/quant.py). `cache_parts`
names the tensors of either kind, every one indexed by block on dim 1, so copying blocks is one
`index_select` / `index_copy_` per part and an int8 cache travels as int8 plus its scales.

The KV stream (one TCP connection per prefill -> decode pair) carries length-prefixed frames:

    u32 LE length | u8 kind | payload
    BLOCKS  str req_id | u32 first_block | u32 num_blocks | u16 num_layers | u8 num_parts
            | per part: u8 dtype code, u8 ndim, ndim x u32 shape of one layer's part [2, n, ...]
            | raw bytes: layer 0 part 0, layer 0 part 1, ..., layer L-1 part P-1 (C order)
    DONE    str req_id | i32 first_token | u32 num_blocks | u64 kv_bytes | u32 num_cached_tokens
            | i64 first_scheduled_ns | i64 prefill_end_ns
    ABORT   str req_id | str reason

Strings are u32 length + UTF-8. `kv_bytes` counts tensor bytes only (what both sides compare).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

KIND_BLOCKS, KIND_DONE, KIND_ABORT = 1, 2, 3
MAX_KV_FRAME_BYTES = 1 << 30  # a longer prefix means a corrupt stream
_LEN = struct.Struct("<I")
_BLOCKS = struct.Struct("<IIHB")
_PART = struct.Struct("<BB")
_DONE = struct.Struct("<iIQIqq")
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int8: 4}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

LayerBlocks = list[torch.Tensor]  # one layer's parts, each [2, n, ...] for n blocks


class KVWireError(Exception):
    """A KV frame that does not decode, or does not fit the receiving cache."""


def cache_parts(layer_cache: object) -> list[torch.Tensor]:
    """The tensors of one layer's cache, each indexed by block on dim 1: the cache itself, or an int8
    cache's values and scales."""
    if isinstance(layer_cache, torch.Tensor):
        return [layer_cache]
    return [layer_cache.values, layer_cache.scales]  # type: ignore[attr-defined]


def read_blocks(kv_caches: list[object], block_ids: list[int]) -> list[LayerBlocks]:
    """Copies of the given blocks of every layer: [layer][part] -> [2, len(block_ids), ...]."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=cache_parts(kv_caches[0])[0].device)
    return [[part.index_select(1, ids).cpu() for part in cache_parts(layer)] for layer in kv_caches]


def write_blocks(kv_caches: list[object], block_ids: list[int], blocks: list[LayerBlocks]) -> None:
    """Write `read_blocks`-shaped data into the given blocks. KVWireError if it does not fit."""
    if len(blocks) != len(kv_caches):
        raise KVWireError(f"KV for {len(blocks)} layers, the cache has {len(kv_caches)}")
    device = cache_parts(kv_caches[0])[0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    for layer, parts in zip(kv_caches, blocks, strict=True):
        mine = cache_parts(layer)
        if len(mine) != len(parts):
            raise KVWireError("the sender's and receiver's KV dtypes differ (int8 on one side only)")
        for dst, src in zip(mine, parts, strict=True):
            if src.dtype != dst.dtype or src.shape[2:] != dst.shape[2:] or src.shape[1] != len(block_ids):
                raise KVWireError(f"KV blocks {tuple(src.shape)} {src.dtype} do not fit {tuple(dst.shape)}")
            dst.index_copy_(1, ids, src.to(device))


def num_tensor_bytes(blocks: list[LayerBlocks]) -> int:
    return sum(p.numel() * p.element_size() for parts in blocks for p in parts)


# -- frames ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class BlocksFrame:
    req_id: str
    first_block: int
    blocks: list[LayerBlocks]

    @property
    def num_blocks(self) -> int:
        return self.blocks[0][0].shape[1] if self.blocks else 0


@dataclass(slots=True)
class DoneFrame:
    req_id: str
    first_token: int
    num_blocks: int
    kv_bytes: int
    num_cached_tokens: int
    first_scheduled_ns: int
    prefill_end_ns: int


@dataclass(slots=True)
class AbortFrame:
    req_id: str
    reason: str


KVFrame = BlocksFrame | DoneFrame | AbortFrame


def _str(s: str) -> bytes:
    b = s.encode()
    return _LEN.pack(len(b)) + b


def encode_blocks(req_id: str, first_block: int, blocks: list[LayerBlocks]) -> list[bytes | memoryview]:
    """A BLOCKS frame as a list of buffers (the tensors' bytes are not copied again)."""
    parts = blocks[0]
    head = bytearray((KIND_BLOCKS,))
    head += _str(req_id)
    head += _BLOCKS.pack(first_block, parts[0].shape[1], len(blocks), len(parts))
    for p in parts:
        head += _PART.pack(DTYPE_CODES[p.dtype], p.dim())
        head += struct.pack(f"<{p.dim()}I", *p.shape)
    raw = [memoryview(p.contiguous().view(torch.uint8).numpy()) for layer in blocks for p in layer]
    length = len(head) + sum(r.nbytes for r in raw)
    return [_LEN.pack(length) + bytes(head), *raw]


def encode_done(d: DoneFrame) -> bytes:
    body = bytes((KIND_DONE,)) + _str(d.req_id)
    body += _DONE.pack(
        d.first_token, d.num_blocks, d.kv_bytes, d.num_cached_tokens, d.first_scheduled_ns, d.prefill_end_ns
    )
    return _LEN.pack(len(body)) + body


def encode_abort(req_id: str, reason: str) -> bytes:
    body = bytes((KIND_ABORT,)) + _str(req_id) + _str(reason)
    return _LEN.pack(len(body)) + body


def decode_frame(body: bytearray) -> KVFrame:
    """One frame body (kind byte + payload). The tensors of BLOCKS share `body`'s memory."""
    try:
        return _decode(body)
    except (struct.error, UnicodeDecodeError, ValueError, KeyError, RuntimeError) as e:
        raise KVWireError(f"bad KV frame: {e}") from e


def _decode(body: bytearray) -> KVFrame:
    view = memoryview(body)
    pos = 1

    def take_str() -> str:
        nonlocal pos
        (n,) = _LEN.unpack_from(view, pos)
        s = str(view[pos + 4 : pos + 4 + n], "utf-8")
        pos += 4 + n
        return s

    kind = body[0]
    req_id = take_str()
    if kind == KIND_DONE:
        return DoneFrame(req_id, *_DONE.unpack_from(view, pos))
    if kind == KIND_ABORT:
        return AbortFrame(req_id, take_str())
    if kind != KIND_BLOCKS:
        raise KVWireError(f"unknown KV frame kind {kind}")
    first, _, num_layers, num_parts = _BLOCKS.unpack_from(view, pos)
    pos += _BLOCKS.size
    specs = []
    for _ in range(num_parts):
        code, ndim = _PART.unpack_from(view, pos)
        shape = struct.unpack_from(f"<{ndim}I", view, pos + _PART.size)
        pos += _PART.size + 4 * ndim
        specs.append((_CODE_DTYPES[code], shape))
    blocks = []
    for _ in range(num_layers):
        parts = []
        for dtype, shape in specs:
            count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw = torch.frombuffer(body, dtype=torch.uint8, count=count, offset=pos) if count else None
            parts.append(raw.view(dtype).view(shape) if raw is not None else torch.empty(shape, dtype=dtype))
            pos += count
        blocks.append(parts)
    if pos != len(body):
        raise KVWireError(f"{len(body) - pos} trailing bytes in a BLOCKS frame")
    return BlocksFrame(req_id, first, blocks)
