"""The device block pool (vLLM v1 semantics, docs/DESIGN.md, "Block pool states").

A block is `in_use` (ref_cnt > 0), `cached_free` (ref_cnt == 0 and still holding a valid hash:
allocatable *and* hittable) or `empty`. Free blocks sit in one doubly linked queue threaded
through the block objects: allocation pops the head (least recently freed), a hit on a
cached-free block unlinks it in O(1), and a freed block goes to the tail. Eviction is lazy: a
cached block keeps its hash until the queue hands it out again, and only then is its hash
dropped (and the eviction reported). Requests free their blocks in reverse order so the tails of
prefix chains are evicted before their heads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from instrumented_engine.core.block_hash import BlockHash


class EvictedDigests:
    """The digests a pool evicted, most recent last, bounded to `capacity` (the oldest are
    forgotten): so that a block computed or loaded again after its eviction is seen as such
    (cache thrash). Not thread-safe: each owner guards it as it guards its pool."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._d: OrderedDict[bytes, None] = OrderedDict()

    def add(self, digest: bytes) -> None:
        d = self._d
        d[digest] = None
        d.move_to_end(digest)
        if len(d) > self.capacity:
            d.popitem(last=False)

    def pop(self, digest: bytes) -> bool:
        """Whether `digest` had been evicted (and forget it: it is cached again)."""
        return self._d.pop(digest, 0) is None

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._d

    def __len__(self) -> int:
        return len(self._d)


def evicted_capacity(num_blocks: int) -> int:
    """How many evicted digests a pool of `num_blocks` remembers: four pools' worth, at least
    65,536 and at most 2^20 (about 100 MB of digests at the most)."""
    return min(1 << 20, max(1 << 16, 4 * num_blocks))


class KVBlock:
    """One KV block: its id (index into the per-layer tensors), ref count, hash, queue links."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; LRU at the head.

    NOTE: a block is linked iff its ref_cnt is 0.
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        """Unlink and return the least recently freed block."""
        b = self._head.next_free
        if b is self._tail or b is None:
            raise ValueError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: KVBlock) -> None:
        """Unlink `b` from anywhere in the queue in O(1)."""
        prev, nxt = b.prev_free, b.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{b} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def append(self, b: KVBlock) -> None:
        """Link `b` at the tail (most recently freed)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = b
        b.prev_free = last
        b.next_free = self._tail
        self._tail.prev_free = b
        self.num_free += 1

    def prepend_n(self, blocks: Sequence[KVBlock]) -> None:
        """Link `blocks` at the head, in the order given (the first is reused first)."""
        first = self._head.next_free
        assert first is not None
        prev = self._head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
            self.num_free += 1
        prev.next_free = first
        first.prev_free = prev

    def ids(self) -> list[int]:
        """Block ids from head to tail (tests and debugging; O(n))."""
        out = []
        b = self._head.next_free
        while b is not None and b is not self._tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    """Blocks, their free queue and the hash → block map of one device pool.

    Args:
        num_blocks: blocks in the pool.
        enable_caching: keep a hash → block map (prefix caching).
        on_evict: called with (block_id, block_hash) just before a cached block is reused;
            the seam where a host tier saves the block's KV (eviction-time offload).
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True,
                 on_evict: Callable[[int, BlockHash], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.on_evict = on_evict
        self.num_cached_free = 0
        #: Blocks evicted since the last `take_evictions()` (the engine reports them as events).
        self.evicted = 0
        #: Digests evicted so far (bounded), to tell a block cached again after its eviction.
        self.gone = EvictedDigests(evicted_capacity(num_blocks))

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def state_counts(self) -> tuple[int, int, int]:
        """(in_use, cached_free, empty) block counts; O(1)."""
        free = self.free_queue.num_free
        return self.num_blocks - free, self.num_cached_free, free - self.num_cached_free

    # ------------------------------------------------------------------ mutations
    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on hit blocks; a cached-free block leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                if b.block_hash is not None:
                    self.num_cached_free -= 1
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop `n` blocks from the head of the free queue, evicting their stale hashes.

        Raises:
            ValueError: fewer than `n` blocks are free (callers check first).
        """
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: KVBlock) -> None:
        h = b.block_hash
        assert h is not None
        if self.on_evict is not None:
            self.on_evict(b.block_id, h)
        if self.cached.get(h) is b:
            del self.cached[h]
            self.gone.add(h)
        b.block_hash = None
        self.num_cached_free -= 1
        self.evicted += 1

    def cache_block(self, b: KVBlock, block_hash: BlockHash) -> bool:
        """Publish a full, computed (or being computed this step) block under `block_hash`.

        If another block already holds the hash (two requests computed the same prefix at
        once), the first stays the cached one and `b` stays unhashed: it becomes `empty` when
        freed.

        Returns:
            Whether this digest had been evicted from the pool earlier (it was needed again:
            recomputed, or loaded from another tier).
        """
        if not self.enable_caching or b.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        b.block_hash = block_hash
        self.cached[block_hash] = b
        return self.gone.pop(block_hash)

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block, in the order given (callers pass reverse order).

        As in vLLM's block pool: blocks that hold no cached hash go to the head of the free
        queue (reused first), cached ones to the tail, so a cached block is never evicted
        while a block with nothing worth keeping is free."""
        empty: list[KVBlock] = []
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"{b} freed twice"
            if b.ref_cnt == 0:
                if b.block_hash is not None:
                    self.free_queue.append(b)
                    self.num_cached_free += 1
                else:
                    empty.append(b)
        if empty:
            self.free_queue.prepend_n(empty)

    def take_evictions(self) -> int:
        """Blocks evicted since the last call."""
        n, self.evicted = self.evicted, 0
        return n

    def reset_cache(self) -> int:
        """Forget every cached hash of free blocks (a cache flush); returns how many."""
        n = 0
        for b in self.blocks:
            if b.ref_cnt == 0 and b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
                n += 1
        self.num_cached_free -= n
        return n
