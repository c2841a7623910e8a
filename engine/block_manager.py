"""Paged KV-cache bookkeeping: a block pool with reference counts, an LRU free list and prefix caching.

Layering as in vLLM v1: the scheduler asks the `KVCacheManager` for slots; the manager works
through the `BlockPool`. Blocks are identified by ids into the runner's cache tensors.

Prefix caching: a full block is named by a chained hash,

    h0 = H(salt,  tokens[0:16])      h1 = H(h0, tokens[16:32])      h2 = H(h1, tokens[32:48]) ...

so equal hashes mean equal whole prefixes. A freed block keeps its hash and contents and sits in
the free list until it is reused (lazy eviction): a later request with the same prefix revives it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.sequence import Sequence


def hash_block(parent: bytes, token_ids: Iterable[int], salt: str = "") -> bytes:
    """Chained block hash: parent hash, the block's token ids, and extra keys (the cache salt)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"#salt:" + salt.encode())
    return h.digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Fixed set of blocks. Free blocks sit in an LRU queue, least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV-cache pool needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.capacity = num_blocks  # blocks with id >= capacity are retired once free

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return sum(1 for b in self.blocks if b.ref_cnt > 0)

    def allocate(self, n: int) -> list[Block]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # lazy eviction of a cached block
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); revive them from the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop references; blocks reaching zero join the tail of the free queue (kept for reuse)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            if block.ref_cnt == 0 and block_id < self.capacity:
                self.free_queue[block_id] = None
            elif block.ref_cnt == 0 and block.block_hash is not None:  # retired by a shrink: forget it,
                if self.cached.get(block.block_hash) == block_id:  # or a prefix hit would revive it
                    del self.cached[block.block_hash]
                block.block_hash = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def register(self, block_id: int, block_hash: bytes) -> None:
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id

    def resize(self, num_blocks: int) -> None:
        """Change the usable pool size. Shrinking retires the highest ids (in use ones once freed)."""
        if num_blocks < 1:
            raise ValueError("the KV-cache pool needs at least one block")
        for i in range(len(self.blocks), num_blocks):
            self.blocks.append(Block(i))
        for i in range(self.capacity, num_blocks):
            if self.blocks[i].ref_cnt == 0:
                self.free_queue[i] = None
        for i in range(num_blocks, self.capacity):
            block = self.blocks[i]
            self.free_queue.pop(i, None)
            if block.block_hash is not None and block.ref_cnt == 0:
                self.cached.pop(block.block_hash, None)
                block.block_hash = None
        self.capacity = num_blocks


class KVCacheManager:
    """Gives sequences the blocks they need, shares full prompt blocks, frees them back."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # prompt tokens found there

    @property
    def num_blocks(self) -> int:
        return self.pool.capacity

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest cached prefix of a new sequence: (block ids, tokens). Leaves >= 1 token to compute."""
        self._hash_full_blocks(seq)
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        # As allocate_slots counts: prefix-hit blocks become the computed tokens of a new sequence.
        computed = len(computed_blocks) * self.block_size if computed_blocks else seq.num_computed_tokens
        need = (
            self.blocks_needed(seq.num_pad_tokens + computed + num_new_tokens)
            - len(seq.block_table)
            - len(computed_blocks)
        )
        revived = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        return need <= self.pool.num_free - revived

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens of `seq` (after taking `computed_blocks`)."""
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            seq.block_table.extend(computed_blocks)
            seq.num_computed_tokens = len(computed_blocks) * self.block_size
        num_cache_tokens = seq.num_pad_tokens + seq.num_computed_tokens + num_new_tokens  # pads first
        need = self.blocks_needed(num_cache_tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(b.block_id for b in self.pool.allocate(need))
        return True

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish blocks that are now full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        self._hash_full_blocks(seq)
        if seq.num_pad_tokens:
            return  # left-padded (static mode): its blocks do not hold what its token hashes name
        num_full = min(
            seq.num_computed_tokens // self.block_size, len(seq.block_hashes), len(seq.block_table)
        )
        for i in range(num_full):
            self.pool.register(seq.block_table[i], seq.block_hashes[i])

    def free(self, seq: Sequence) -> None:
        """Release all blocks of `seq`, tail first so that prefix blocks are evicted last."""
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_pad_tokens = 0

    def _hash_full_blocks(self, seq: Sequence) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else b""
            salt = seq.cache_salt if i == 0 else ""
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], salt))

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError unless ref counts equal the live block tables and the free list is exact."""
        refs = [0] * len(self.pool.blocks)
        for seq in live:
            for b in seq.block_table:
                refs[b] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs[block.block_id]}"
            )
            in_free = block.block_id in self.pool.free_queue
            should = block.ref_cnt == 0 and block.block_id < self.pool.capacity
            assert in_free == should, f"block {block.block_id} free-list membership wrong"
        for h, i in self.pool.cached.items():
            assert self.pool.blocks[i].block_hash == h, f"cached hash of block {i} stale"
