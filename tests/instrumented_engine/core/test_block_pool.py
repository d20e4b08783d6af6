"""Block pool semantics with exact block ids and free-queue order (vLLM v1's)."""

from __future__ import annotations

import pytest

from instrumented_engine.core.block_hash import namespace_digest
from instrumented_engine.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from instrumented_engine.core.kv_cache_manager import KVCacheManager
from instrumented_engine.core.request import Request, SamplingParams

BS = 4
NS = namespace_digest({"model_id": "m", "revision": "r", "dtype": "float32", "adapter_id": ""})


def make_request(rid: str, prompt: list[int], ns: bytes = NS) -> Request:
    return Request(rid, prompt, 4, SamplingParams(), tenant=None, cache_salt=None, namespace=ns)


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit `req` with its whole prompt, like the scheduler; returns its block ids."""
    kv.hash_prompt(req)
    hits = kv.get_computed_blocks(req)
    n_hit = len(hits) * BS
    assert kv.allocate_slots(req, req.num_tokens - n_hit, hits)
    req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in req.blocks]


def test_fresh_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(6)
    assert pool.free_queue.ids() == [0, 1, 2, 3, 4, 5]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]
    assert pool.free_queue.ids() == [2, 3, 4, 5]
    assert pool.state_counts() == (2, 0, 4)


def test_finished_request_frees_in_reverse_and_keeps_hashes() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, a) == [0, 1, 2]
    assert pool.state_counts() == (3, 0, 5)
    kv.free(a)
    # The partial block 2 holds no hash: it goes to the head (reused first); the cached
    # blocks go to the tail in reverse order, the chain tail 1 before its head 0.
    assert pool.free_queue.ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert [b.ref_cnt for b in pool.blocks[:3]] == [0, 0, 0]
    # Full blocks keep their hashes (cached_free); the partial block was never hashed (empty).
    assert pool.state_counts() == (0, 2, 6)
    assert set(pool.cached.values()) == {pool.blocks[0], pool.blocks[1]}


def test_hit_on_cached_free_block_leaves_the_queue_in_place() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", [*range(8), 99, 98, 97])  # shares a's 2 full blocks
    assert admit(kv, b) == [0, 1, 2]  # hits 0 and 1, one new block from the head (2)
    assert b.num_cached_blocks == 2
    # 0 and 1 were unlinked from the tail; the rest keep their order.
    assert pool.free_queue.ids() == [3, 4, 5, 6, 7]
    assert pool.state_counts() == (3, 0, 5)


def test_a_cached_block_is_not_evicted_while_an_empty_block_is_free() -> None:
    """A pool of four: a (two full blocks) and b (one full, one partial) finish, a first. In
    freeing order alone the queue would be [1, 0, 3, 2] and c's one new block would evict a's
    cached block 1 while b's empty block 3 is free; empty blocks go to the head instead."""
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(8)))  # 2 full blocks
    b = make_request("b", [50, 51, 52, 53, 54, 55])  # 1 full block + 2 tokens
    assert admit(kv, a) == [0, 1] and admit(kv, b) == [2, 3]
    kv.free(a)
    kv.free(b)
    assert pool.free_queue.ids() == [3, 1, 0, 2]
    c = make_request("c", [90, 91])  # no hit, one new block
    assert admit(kv, c) == [3]
    assert set(pool.cached.values()) == {pool.blocks[0], pool.blocks[1], pool.blocks[2]}
    assert pool.take_evictions() == 0
    # A later prompt sharing a's prefix still hits both of its blocks.
    d = make_request("d", [*range(8), 7])
    assert admit(kv, d)[:2] == [0, 1] and d.num_cached_blocks == 2


def test_lazy_eviction_pops_lru_first_and_evicts_chain_tails_first() -> None:
    evicted: list[int] = []
    pool = BlockPool(5, on_evict=lambda block_id, _h: evicted.append(block_id))
    kv = KVCacheManager(pool, BS)
    a = make_request("a", [*range(12), 1])  # 3 full blocks + 1 token → blocks 0..3
    assert admit(kv, a) == [0, 1, 2, 3]
    kv.free(a)
    assert pool.free_queue.ids() == [3, 4, 2, 1, 0]  # the partial block 3 first (no hash)
    assert pool.state_counts() == (0, 3, 2)
    # Nothing is evicted at free time: the hashes stay until the blocks are reallocated.
    assert len(pool.cached) == 3 and evicted == []
    c = make_request("c", [500 + i for i in range(14)])  # unrelated: 4 blocks
    assert admit(kv, c) == [3, 4, 2, 1]
    assert evicted == [2, 1]  # the tail of a's chain goes first
    assert pool.take_evictions() == 2
    assert pool.take_evictions() == 0
    # a's head block survives and is still hittable.
    a2 = make_request("a2", [*range(4), 7, 7])
    kv.hash_prompt(a2)
    assert [blk.block_id for blk in kv.get_computed_blocks(a2)] == [0]


def test_ref_counts_under_sharing() -> None:
    pool = BlockPool(10)
    kv = KVCacheManager(pool, BS)
    prefix = list(range(8))
    a = make_request("a", [*prefix, 50, 51])
    b = make_request("b", [*prefix, 60, 61, 62])
    assert admit(kv, a) == [0, 1, 2]
    assert admit(kv, b) == [0, 1, 3]  # same-step sharing of a's published full blocks
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert pool.free_queue.ids() == [2, 4, 5, 6, 7, 8, 9]  # shared blocks stay in use
    kv.free(b)
    assert pool.free_queue.ids() == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    assert pool.state_counts() == (0, 2, 8)


def test_two_requests_computing_one_prefix_keep_one_cached_copy() -> None:
    pool = BlockPool(6)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(5)))
    b = make_request("b", list(range(5)))
    # Both admitted before either publishes: allocate b's block while a's is unhashed.
    kv.hash_prompt(a)
    kv.hash_prompt(b)
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 5)
    assert pool.cached[a.block_hashes[0]] is pool.blocks[0]
    assert pool.blocks[2].block_hash is None  # b's duplicate stays unhashed
    kv.free(b)
    kv.free(a)
    assert pool.state_counts() == (0, 1, 5)


def test_allocation_failure_changes_nothing() -> None:
    pool = BlockPool(3)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(9)))  # needs 3 blocks
    kv.hash_prompt(a)
    assert kv.allocate_slots(a, 9)
    b = make_request("b", list(range(100, 105)))
    kv.hash_prompt(b)
    assert not kv.allocate_slots(b, 5)
    assert b.blocks == [] and pool.state_counts() == (3, 0, 0)


def test_cached_free_hits_count_against_free_blocks() -> None:
    pool = BlockPool(3)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)  # blocks 0, 1 cached-free, 2 empty
    b = make_request("b", [*range(8), 1, 2, 3, 4, 5])  # hits 0, 1; needs 2 more blocks
    kv.hash_prompt(b)
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    # 2 new blocks + 2 hits taken out of the queue > 3 free blocks.
    assert not kv.allocate_slots(b, 5, hits)
    assert pool.free_queue.ids() == [2, 1, 0]


def test_prefix_caching_off_never_hits() -> None:
    pool = BlockPool(8, enable_caching=False)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(10)))
    kv.hash_prompt(b)
    assert kv.probe(b) == 0 and kv.get_computed_blocks(b) == []
    assert pool.state_counts() == (0, 0, 8)


def test_reset_cache_forgets_free_blocks_only() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(100, 109)))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    assert pool.reset_cache() == 2
    assert pool.state_counts() == (3, 0, 5)
    assert len(pool.cached) == 2  # b's blocks are in use and stay cached


def test_free_queue_rejects_misuse() -> None:
    q = FreeBlockQueue([])
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(KVBlock(3))
