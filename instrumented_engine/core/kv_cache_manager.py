"""Per-request block tables over the device pool: prefix lookup, allocation, freeing."""

from __future__ import annotations

from collections.abc import Sequence

from instrumented_engine.core.block_hash import extend_block_hashes
from instrumented_engine.core.block_pool import BlockPool, KVBlock
from instrumented_engine.core.request import Request


class KVCacheManager:
    """Allocates and frees a request's blocks in a `BlockPool` and finds cached prefixes.

    Args:
        pool: the device block pool.
        block_size: tokens per block.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        #: Chain positions of the blocks the last `allocate_slots` cached again after an
        #: earlier eviction.
        self.recached: list[int] = []

    def hash_prompt(self, req: Request) -> None:
        """Compute the chained digests of the request's full blocks (at arrival)."""
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, req.namespace)

    def _max_hit_blocks(self, req: Request) -> int:
        # NOTE: a hit never covers the last known token: its logits must be computed.
        return (req.num_tokens - 1) // self.block_size

    def probe(self, req: Request) -> int:
        """Blocks of the request's prefix the device pool holds now (a promise: takes no
        reference, so they may be evicted before admission)."""
        if not self.pool.enable_caching:
            return 0
        cached = self.pool.cached
        n = 0
        for h in req.block_hashes[: self._max_hit_blocks(req)]:
            if h not in cached:
                break
            n += 1
        return n

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The longest cached prefix of the request now (re-validated at admission)."""
        if not self.pool.enable_caching:
            return []
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, req.namespace)
        out: list[KVBlock] = []
        get = self.pool.cached.get
        for h in req.block_hashes[: self._max_hit_blocks(req)]:
            b = get(h)
            if b is None:
                break
            out.append(b)
        return out

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed: Sequence[KVBlock] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens after its computed ones.

        Args:
            req: the request (its `num_computed_tokens` excludes `new_computed`).
            num_new_tokens: tokens to compute in this step.
            new_computed: cache-hit blocks taken at admission.

        Returns:
            False (and changes nothing) when the pool lacks free blocks.
        """
        bs = self.block_size
        self.recached = []
        total = req.num_computed_tokens + len(new_computed) * bs + num_new_tokens
        need = -(-total // bs) - len(req.blocks) - len(new_computed)
        # A hit on a cached-free block takes it out of the free queue too.
        evictable_hits = sum(1 for b in new_computed if b.ref_cnt == 0)
        if max(need, 0) + evictable_hits > self.pool.num_free_blocks:
            return False
        if new_computed:
            self.pool.touch(new_computed)
            req.blocks.extend(new_computed)
            req.num_cached_blocks = len(req.blocks)
        if need > 0:
            req.blocks.extend(self.pool.get_new_blocks(need))
        if self.pool.enable_caching:
            # Blocks full after this step are published now: a batch-mate admitted in this
            # same step may hit them, since every layer writes the whole batch's KV before any
            # request attends.
            n_full = total // bs
            if n_full > req.num_cached_blocks:
                extend_block_hashes(req.block_hashes, req.token_ids[: n_full * bs], bs,
                                    req.namespace)
                again = self.recached
                for i in range(req.num_cached_blocks, n_full):
                    if self.pool.cache_block(req.blocks[i], req.block_hashes[i]):
                        again.append(i)
                req.num_cached_blocks = n_full
        return True

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first (chain tails are evicted before heads)."""
        self.pool.free(reversed(req.blocks))
        req.blocks = []
        req.num_cached_blocks = 0
