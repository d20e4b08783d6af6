"""Per-request block tables over the device pool: prefix lookup, allocation, freeing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

    def state_counts(self) -> tuple[int, int, int]:
        """(in_use, cached_free, empty) of the device pool."""
        return self.pool.state_counts()

    def take_evictions(self) -> int:
        """Blocks the device pool evicted since the last call."""
        return self.pool.take_evictions()

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


class GroupRules:
    """The block rules of one KV-cache group (vLLM's single-type managers, one per kind).

    Full attention (`window` None) needs every block of the context: its usable hit is the
    longest cached prefix, and it frees nothing while a request runs. A sliding-window layer
    attends to itself and the `window - 1` tokens before it: a hit ending at block L needs only
    the `ceil((window - 1) / block_size)` blocks before L (the earlier ones are *skipped*: never
    read, never recomputed), and once a request's next token is past a block's last token by a
    whole window, that block is freed (`None` in the group's block table).
    """

    def __init__(self, pool: BlockPool, block_size: int, window: int | None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.window = window
        #: Blocks before a hit's end that the window reads (0: full attention reads all).
        self.need = 0 if window is None else -(-(window - 1) // block_size)

    def hit_blocks(self, hashes: Sequence[bytes], limit: int) -> int:
        """The longest usable hit, in blocks, no longer than `limit`."""
        if not self.pool.enable_caching or limit <= 0:
            return 0
        cached = self.pool.cached
        if self.window is None:
            n = 0
            for h in hashes[:limit]:
                if h not in cached:
                    break
                n += 1
            return n
        # Right to left: the first run of `need` cached blocks ends the longest usable hit; a
        # run reaching block 0 is usable whatever its length.
        run = 0
        for i in range(limit - 1, -1, -1):
            if hashes[i] in cached:
                run += 1
                if run >= self.need:
                    return i + self.need
            else:
                run = 0
        return run

    def hit_table(self, hashes: Sequence[bytes], n: int) -> list[KVBlock | None]:
        """The block table of a hit of `n` blocks (None where the window skips)."""
        first = max(0, n - self.need) if self.window is not None else 0
        get = self.pool.cached.__getitem__
        return [None] * first + [get(h) for h in hashes[first:n]]

    def skipped_blocks(self, num_computed: int) -> int:
        """Leading blocks no later token of the request reads (0 for full attention)."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def skipped_tokens(self, hit_tokens: int) -> int:
        """Of a hit of `hit_tokens`, the tokens this group neither reads nor recomputes."""
        if self.window is None:
            return 0
        return max(0, hit_tokens // self.block_size - self.need) * self.block_size


class HybridKVCacheManager:
    """Block tables for models whose layers form several KV-cache groups (sliding-window
    layers beside full-attention ones), with one device pool per group.

    A request holds one block table per group (`req.group_blocks`). A prefix hit must be
    usable by **every** group, so the usable hit is the shortest of the groups' limits: the
    full-attention group's longest cached prefix, shortened by each window group to the longest
    length whose last window of blocks that group still holds (`GroupRules.hit_blocks`). When a
    group shortens the hit, the request's `group_limit` says by how many tokens and which group.
    The interface is `KVCacheManager`'s, so the scheduler drives both alike.

    Args:
        groups: the model's layer groups (`ModelConfig.layer_groups()`).
        pools: one device pool per group, in the same order.
        block_size: tokens per block (one chain of digests serves every group).
    """

    def __init__(self, groups: Sequence[Any], pools: Sequence[BlockPool], block_size: int) -> None:
        if len(groups) != len(pools) or not groups:
            raise ValueError("one pool per layer group")
        self.groups = tuple(groups)
        self.pools = tuple(pools)
        self.pool = pools[0]
        self.block_size = block_size
        self.rules = [GroupRules(p, block_size, g.window) for g, p in zip(groups, pools,
                                                                          strict=True)]
        if sum(g.window is not None for g in groups) > 1 or (
                len(groups) > 1 and groups[0].window is not None):
            raise ValueError("layer groups: full attention first, then at most one window")
        #: Layer i's group index.
        self.layer_group: tuple[int, ...] = tuple(
            g for _, g in sorted((layer, g) for g, grp in enumerate(groups)
                                 for layer in grp.layers))
        self.recached: list[int] = []
        #: Per request (by id): the hit tables `get_computed_blocks` found for the groups after
        #: the first, taken by the next `allocate_slots` of that request.
        self._pending: dict[str, list[list[KVBlock | None]]] = {}

    # ------------------------------------------------------------------ queries
    def state_counts(self) -> tuple[int, int, int]:
        """(in_use, cached_free, empty) summed over the groups' pools."""
        counts = [p.state_counts() for p in self.pools]
        return (sum(c[0] for c in counts), sum(c[1] for c in counts),
                sum(c[2] for c in counts))

    def take_evictions(self) -> int:
        return sum(p.take_evictions() for p in self.pools)

    def hash_prompt(self, req: Request) -> None:
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, req.namespace)

    def _limits(self, req: Request) -> tuple[int, list[int]]:
        """(usable hit in blocks, each group's own limit) for the request now."""
        limit = (req.num_tokens - 1) // self.block_size
        per = []
        # NOTE: one pass is exact: the full-attention group comes first and any prefix of its
        # hit is a hit too, and there is at most one window group (one `sliding_window`).
        for rules in self.rules:
            limit = rules.hit_blocks(req.block_hashes, limit)
            per.append(limit)
        return limit, per

    def probe(self, req: Request) -> int:
        """Usable hit blocks now (a promise: no reference taken)."""
        return self._limits(req)[0]

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The usable hit, as blocks of the first group (the others are kept for
        `allocate_slots`); sets `req.group_limit`."""
        self.hash_prompt(req)
        n, per = self._limits(req)
        req.group_limit = (0, -1)
        top = per[0]
        if top > n:
            # The first group held more than every group can use: name the group that cut it.
            worst = min(range(len(per)), key=lambda g: (per[g], g))
            req.group_limit = ((top - n) * self.block_size, worst)
        if not n:
            self._pending.pop(req.request_id, None)
            return []
        tables = [r.hit_table(req.block_hashes, n) for r in self.rules]
        self._pending[req.request_id] = tables[1:]
        # NOTE: when the first group is a window group its skipped hit blocks are None; the
        # scheduler only counts this list and hands it back to `allocate_slots`.
        return tables[0]  # type: ignore[return-value]

    # ------------------------------------------------------------------ mutations
    def _tables(self, req: Request) -> list[list[KVBlock | None]]:
        if not req.group_blocks:
            req.group_blocks = [[] for _ in self.rules]
            req.group_cached = [0] * len(self.rules)
        return req.group_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed: Sequence[KVBlock] = ()) -> bool:
        """As `KVCacheManager.allocate_slots`, for every group at once (all or nothing).

        Before allocating, each window group frees the blocks no later token reads."""
        bs = self.block_size
        self.recached = []
        tables = self._tables(req)
        pending = self._pending.get(req.request_id) if new_computed else None
        hits: list[list[KVBlock | None]] = [list(new_computed),
                                            *(pending or [[] for _ in self.rules[1:]])]
        n_hit = len(hits[0])
        computed = req.num_computed_tokens + n_hit * bs
        total = computed + num_new_tokens
        for rules, table in zip(self.rules, tables, strict=True):
            self._free_skipped(rules, table, req.num_computed_tokens)
        needs = []
        for rules, table, hit in zip(self.rules, tables, hits, strict=True):
            need = max(0, -(-total // bs) - len(table) - len(hit))
            evictable = sum(1 for b in hit if b is not None and b.ref_cnt == 0)
            if need + evictable > rules.pool.num_free_blocks:
                return False
            needs.append(need)
        self._pending.pop(req.request_id, None)
        for g, (rules, table, hit, need) in enumerate(zip(self.rules, tables, hits, needs,
                                                          strict=True)):
            pool = rules.pool
            if hit:
                pool.touch([b for b in hit if b is not None])
                table.extend(hit)
                req.group_cached[g] = len(table)
            if need:
                table.extend(pool.get_new_blocks(need))
            if pool.enable_caching:
                n_full = total // bs
                if n_full > req.group_cached[g]:
                    extend_block_hashes(req.block_hashes, req.token_ids[: n_full * bs], bs,
                                        req.namespace)
                    for i in range(req.group_cached[g], n_full):
                        b = table[i]
                        if b is not None and pool.cache_block(b, req.block_hashes[i]) and g == 0:
                            self.recached.append(i)
                    req.group_cached[g] = n_full
        # The first group's table, for what counts positions (the tiers' writes); block ids
        # go through `block_ids` (one per layer).
        req.blocks = tables[0]  # type: ignore[assignment]
        req.num_cached_blocks = req.group_cached[0]
        return True

    @staticmethod
    def _free_skipped(rules: GroupRules, table: list[KVBlock | None], num_computed: int) -> None:
        n = min(rules.skipped_blocks(num_computed), len(table))
        gone = [b for b in table[:n] if b is not None]
        if gone:
            rules.pool.free(reversed(gone))
            for i in range(n):
                table[i] = None

    def free(self, req: Request) -> None:
        """Release every group's blocks, tail first."""
        for rules, table in zip(self.rules, req.group_blocks or (), strict=False):
            rules.pool.free(reversed([b for b in table if b is not None]))
        self._pending.pop(req.request_id, None)
        req.group_blocks = []
        req.group_cached = []
        req.blocks = []
        req.num_cached_blocks = 0

    def block_tables(self, req: Request) -> list[list[int]]:
        """Per group, the block ids of the request's table (0 where a window skipped: those
        slots are never read or written)."""
        return [[0 if b is None else b.block_id for b in t] for t in req.group_blocks]

    def layer_split(self, device_hit: int, loaded: int) -> list[tuple[int, int, int]]:
        """Per layer, (hit, loaded, skipped) tokens of an admission that reused `device_hit`
        tokens from the device and `loaded` more from the tiers (both block-aligned): a window
        layer reads only the blocks before the reuse's end that its window covers."""
        end = device_hit + loaded
        per_group = []
        for r in self.rules:
            skipped = r.skipped_tokens(end)
            per_group.append((max(0, device_hit - skipped), end - max(device_hit, skipped),
                              skipped))
        return [per_group[g] for g in self.layer_group]

    def layer_ids(self) -> Any:
        """(request, chain position) → that position's block id per layer (None when a group
        no longer holds it): the tiers copy every layer of a position, each into its group's
        block."""
        layer_group = self.layer_group

        def ids(req: Request, i: int) -> tuple[int, ...] | None:
            per_group = []
            for table in req.group_blocks:
                b = table[i] if i < len(table) else None
                if b is None:
                    return None
                per_group.append(b.block_id)
            return tuple(per_group[g] for g in layer_group)
        return ids

    def evicted_ids(self) -> Any:
        """(block id, digest) of a block the first group's pool evicts → that position's block
        id per layer, looked up by digest in the other groups' pools (None when one of them no
        longer holds it: then no whole object can be saved)."""
        layer_group = self.layer_group

        def ids(block_id: int, digest: bytes) -> tuple[int, ...] | None:
            per_group = [block_id]
            for pool in self.pools[1:]:
                b = pool.cached.get(digest)
                if b is None:
                    return None
                per_group.append(b.block_id)
            return tuple(per_group[g] for g in layer_group)
        return ids
