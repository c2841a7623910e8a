"""The block pool and prefix cache, on their own."""

import pytest

from engine.block_manager import KVCacheManager, hash_block
from engine.config import SamplingParams
from engine.request import EngineRequest
from engine.sequence import Sequence


def make_seq(tokens: list[int], salt: str = "", req_id: str = "r") -> Sequence:
    return Sequence.from_request(EngineRequest(req_id, tokens, SamplingParams(), cache_salt=salt))


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit a whole prompt as the scheduler would; return the prefix-hit tokens."""
    hits, hit_tokens = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - hit_tokens, hits)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return hit_tokens


def test_chained_hash_depends_on_whole_prefix_and_salt():
    a = hash_block(b"", [1, 2, 3, 4])
    assert hash_block(b"", [1, 2, 3, 4]) == a
    assert hash_block(a, [5, 6]) != hash_block(hash_block(b"", [9, 2, 3, 4]), [5, 6])
    assert hash_block(b"", [1, 2, 3, 4], salt="tenant-b") != a


def test_allocation_covers_tokens_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    admit(kv, seq)
    assert len(seq.block_table) == 3
    assert kv.num_free_blocks == 5
    kv.free(seq)
    assert kv.num_free_blocks == 8
    kv.check_invariants([])


def test_shared_prefix_is_served_from_cache_and_reference_counted():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_seq([7] * 12 + [1, 2], req_id="a")
    second = make_seq([7] * 12 + [3, 4, 5], req_id="b")
    assert admit(kv, first) == 0
    assert admit(kv, second) == 12
    assert second.block_table[:3] == first.block_table[:3]
    assert all(kv.pool.blocks[b].ref_cnt == 2 for b in first.block_table[:3])
    kv.check_invariants([first, second])
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)  # only the scheduler records lookups


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_seq(list(range(8)), req_id="a"))
    again = make_seq(list(range(8)), req_id="b")
    _, hit_tokens = kv.get_computed_blocks(again)
    assert hit_tokens == 4  # the second block would leave nothing to compute


def test_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_seq(list(range(9)), salt="x", req_id="a"))
    assert admit(kv, make_seq(list(range(9)), salt="y", req_id="b")) == 0
    assert admit(kv, make_seq(list(range(9)), salt="x", req_id="c")) == 8


def test_freed_blocks_stay_cached_until_reused_lru_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    old = make_seq(list(range(8)) + [99], req_id="old")
    admit(kv, old)
    kv.free(old)
    assert admit(kv, make_seq(list(range(8)) + [98], req_id="revived")) == 8  # lazy eviction: still there
    kv2 = KVCacheManager(num_blocks=3, block_size=4)
    a = make_seq(list(range(8)) + [1], req_id="a")
    admit(kv2, a)
    kv2.free(a)
    b = make_seq([50 + i for i in range(9)], req_id="b")  # needs all 3 blocks: evicts the cached ones
    admit(kv2, b)
    kv2.free(b)
    c = make_seq(list(range(8)) + [1], req_id="c")
    assert admit(kv2, c) == 0  # evicted by b
    kv2.check_invariants([c])


def test_allocation_fails_cleanly_when_the_pool_is_full():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    hits, _ = kv.get_computed_blocks(seq)
    assert not kv.allocate_slots(seq, 12, hits)
    assert seq.block_table == [] and kv.num_free_blocks == 2
    kv.check_invariants([seq])


def test_shrinking_retires_blocks_once_free_and_growing_adds_them():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(30)))
    admit(kv, seq)  # 8 blocks, all in use
    kv.pool.resize(4)
    assert kv.num_blocks == 4 and kv.num_free_blocks == 0
    kv.free(seq)
    assert kv.num_free_blocks == 4
    kv.check_invariants([])
    kv.pool.resize(10)
    assert kv.num_free_blocks == 10
    kv.check_invariants([])


def test_double_free_is_an_error():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    seq = make_seq([1, 2, 3])
    admit(kv, seq)
    table = list(seq.block_table)
    kv.free(seq)
    with pytest.raises(RuntimeError):
        kv.pool.free(table)
