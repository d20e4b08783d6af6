"""The host tier: a fixed-size pool of CPU KV blocks with its own digest index and LRU.

The pool is one preallocated tensor of `num_blocks` payloads, (N, num_layers, 2, block_size,
nkv, hd), pinned when CUDA is present so H2D copies can run asynchronously. A slot is *indexed*
(visible to `lookup`/`get`), *reserved* (being filled, e.g. by a remote read; invisible until
`commit`), or free. Every indexed slot sits in an OrderedDict kept in LRU order (oldest first),
so hits, puts and evictions are O(1) (an eviction skips referenced blocks at the LRU head).

A slot with a non-zero ref count (`acquire`, `reserve`) is never evicted: a block being copied
to the device, or filled by a remote read that may still complete late, keeps its memory.

NOTE: one lock guards the index; `lookup` runs on the arrival thread while the engine loop and
the write-behind worker `put`. Tensor copies into slots happen outside the lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from instrumented_engine.core.block_pool import EvictedDigests, evicted_capacity
from instrumented_engine.tiers.format import BlockLayout, byte_view
from instrumented_engine.tiers.stats import OpStats


class HostPoolFull(Exception):
    """Every slot is referenced: nothing can be evicted to make room."""


class HostKVPool:
    """A CPU block pool indexed by chain digest.

    Args:
        layout: the engine's block layout.
        num_blocks: slots in the pool (>= 1).
        pin: pin the pool's memory; None pins when CUDA is available.
        recorder: optional agent.telemetry.Recorder for `host_put` activity spans.
    """

    name = "host"

    def __init__(self, layout: BlockLayout, num_blocks: int, *, pin: bool | None = None,
                 recorder: Any = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.layout = layout
        self.num_blocks = num_blocks
        buf = torch.empty((num_blocks, *layout.payload_shape), dtype=layout.dtype)
        if pin is None:
            pin = torch.cuda.is_available()
        self.buffer = buf.pin_memory() if pin else buf
        self.pinned = bool(pin)
        # (N, payload_bytes) uint8 rows over the same memory: a remote read fills a slot
        # through its row without per-block tensor overhead.
        self._rows = byte_view(self.buffer).reshape(num_blocks, -1)
        self.recorder = recorder
        self.stats = OpStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # LRU order, oldest first
        self._reserved: dict[bytes, int] = {}
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out slot 0 first
        self._gone = EvictedDigests(evicted_capacity(num_blocks))

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._index

    def referenced(self) -> int:
        """Blocks held now (acquired, pinned for a request, or being filled)."""
        with self._lock:
            return sum(1 for r in self._refs if r)

    def was_evicted(self, digest: bytes) -> bool:
        """Whether the pool evicted `digest` and does not hold it again (bounded memory)."""
        with self._lock:
            return digest in self._gone and digest not in self._index

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0) -> int:
        """Contiguous blocks held from `block_hashes[start]` on; hits become most recent.

        Returns:
            The number of blocks (0 when the first is missing).
        """
        n = 0
        with self._lock:
            for h in block_hashes[start:]:
                if h not in self._index:
                    break
                self._index.move_to_end(h)
                n += 1
        self.stats.add("lookup_blocks", len(block_hashes) - start)
        self.stats.add("lookup_hit_blocks", n)
        return n

    def state_counts(self) -> tuple[int, int, int]:
        """(being filled, indexed, free) slot counts; O(1). Indexed slots are hittable (some
        may be acquired by a copy in flight)."""
        with self._lock:
            indexed, free = len(self._index), len(self._free)
        return self.num_blocks - indexed - free, indexed, free

    def lru_order(self) -> list[bytes]:
        """Indexed digests, least recently used first (tests and debugging)."""
        with self._lock:
            return list(self._index)

    def get(self, digest: bytes) -> torch.Tensor | None:
        """The slot holding `digest` (a view into the pool) or None; a hit becomes most recent.

        NOTE: the view is only safe while the slot cannot be evicted: use `acquire` when the
        copy may overlap other `put`s.
        """
        with self._lock:
            slot = self._index.get(digest)
            if slot is None:
                return None
            self._index.move_to_end(digest)
        return self.buffer[slot]

    def acquire(self, digest: bytes) -> torch.Tensor | None:
        """Like `get`, and pin the slot against eviction until `release(digest)`."""
        with self._lock:
            slot = self._index.get(digest)
            if slot is None:
                return None
            self._index.move_to_end(digest)
            self._refs[slot] += 1
        return self.buffer[slot]

    def release(self, digest: bytes) -> None:
        """Drop one reference taken by `acquire`."""
        with self._lock:
            slot = self._index[digest]
            assert self._refs[slot] > 0, "release without acquire"
            self._refs[slot] -= 1

    # ------------------------------------------------------------------ insertion
    def _take_slot(self) -> tuple[int, bytes | None]:
        """(under the lock) a free slot, evicting the least recent unreferenced block."""
        if self._free:
            return self._free.pop(), None
        for victim, slot in self._index.items():
            if self._refs[slot] == 0:
                del self._index[victim]
                self._gone.add(victim)
                self.stats.add("evictions")
                return slot, victim
        raise HostPoolFull(f"all {self.num_blocks} host blocks are referenced")

    def put(self, digest: bytes, payload: torch.Tensor) -> list[bytes]:
        """Store a block (a copy of `payload`), evicting the least recently used if full.

        A digest already held is only made most recent (its bytes are the same by identity).

        Returns:
            Digests evicted to make room (0 or 1).

        Raises:
            HostPoolFull: every slot is referenced.
        """
        t0 = time.monotonic_ns()
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)
                return []
            slot, victim = self._take_slot()
            self._refs[slot] = 1  # invisible and unevictable while the copy runs
        try:
            self.buffer[slot].copy_(payload)
        except BaseException:
            with self._lock:
                self._refs[slot] = 0
                self._free.append(slot)
            raise
        with self._lock:
            self._refs[slot] = 0
            if digest in self._index:  # a concurrent put of the same block won
                self._free.append(slot)
            else:
                self._index[digest] = slot
        t1 = time.monotonic_ns()
        nbytes = self.layout.payload_bytes
        self.stats.op("put", t1 - t0)
        self.stats.add("bytes_written", nbytes)
        if self.recorder is not None:
            self.recorder.activity("host_put", t0, t1, tier="host", tokens=self.layout.block_size,
                                   nbytes=nbytes, transfer_id=self.recorder.new_transfer_id())
        return [] if victim is None else [victim]

    def reserve(self, digest: bytes) -> tuple[torch.Tensor, list[bytes]]:
        """A slot to fill in place (a remote read's destination), invisible until `commit`.

        Returns:
            (the slot view, digests evicted to make room).

        Raises:
            HostPoolFull: every slot is referenced.
            KeyError: `digest` is already reserved.
        """
        with self._lock:
            if digest in self._reserved:
                raise KeyError(f"{digest.hex()} is already reserved")
            slot, victim = self._take_slot()
            self._refs[slot] = 1
            self._reserved[digest] = slot
        return self.buffer[slot], ([] if victim is None else [victim])

    def slot_bytes(self, digest: bytes) -> np.ndarray:
        """The uint8 bytes of a reserved (or else indexed) block's slot: a destination for
        `ResilientRemote.read_into`.

        Raises:
            KeyError: `digest` is neither reserved nor indexed.
        """
        with self._lock:
            slot = self._reserved.get(digest)
            if slot is None:
                slot = self._index[digest]
        return self._rows[slot]

    def commit(self, digest: bytes, *, pin: bool = False) -> None:
        """Publish a reserved slot: it becomes indexed and most recent; with `pin`, it is
        also acquired (held against eviction until `release`), for whoever the fill is for."""
        with self._lock:
            slot = self._reserved.pop(digest)
            self._refs[slot] = 0
            if digest in self._index:
                self._free.append(slot)
                slot = self._index[digest]
            else:
                self._index[digest] = slot
            if pin:
                self._refs[slot] += 1
        self.stats.add("bytes_written", self.layout.payload_bytes)

    def abort(self, digest: bytes) -> None:
        """Return a reserved slot to the free list (the fill failed or was abandoned)."""
        with self._lock:
            slot = self._reserved.pop(digest)
            self._refs[slot] = 0
            self._free.append(slot)

    def evict(self, digest: bytes) -> bool:
        """Drop a block now (tests, invalidation); False when absent or referenced."""
        with self._lock:
            slot = self._index.get(digest)
            if slot is None or self._refs[slot]:
                return False
            del self._index[digest]
            self._free.append(slot)
        return True
