"""Eviction-time offload: a device block about to be reused is saved to the host tier first.

This is the `host_write="evict"` path (the `BlockPool.on_evict` seam): the host tier then holds
what the device pool dropped, so a later request can load it back instead of recomputing it.
It runs on the engine loop, inside the allocation that evicts the block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from instrumented_engine.core.block_hash import BlockHash
from instrumented_engine.tiers.format import BlockIds, gather_block
from instrumented_engine.tiers.host import HostKVPool, HostPoolFull


class EvictionOffload:
    """Copies evicted device blocks into `host`.

    Args:
        host: the host tier.
        kv_caches: the engine's device cache (per layer (k, v)).
        ids_of: (block id, digest) → the block id per layer of that position, or None when
            it cannot be saved whole (layer groups with pools of their own: a window group
            freed and reused its block first); default: the evicted id for every layer.

    Attributes:
        offloaded: blocks saved.
        skipped: blocks not saved because every host slot was referenced (or, with layer
            groups, another group no longer held the position).
    """

    def __init__(self, host: HostKVPool, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 ids_of: Callable[[int, BlockHash], BlockIds | None] | None = None) -> None:
        self.host = host
        self.ids_of = ids_of
        self.kv_caches = kv_caches
        self.offloaded = 0
        self.skipped = 0

    def __call__(self, block_id: int, block_hash: BlockHash) -> None:
        """(BlockPool) save device block `block_id` before it is reused."""
        host = self.host
        if block_hash in host:
            return
        ids: BlockIds | None = block_id
        if self.ids_of is not None:
            ids = self.ids_of(block_id, block_hash)
            if ids is None:
                self.skipped += 1
                return
        try:
            view, _ = host.reserve(block_hash)
        except (HostPoolFull, KeyError):
            self.skipped += 1
            return
        try:
            gather_block(self.kv_caches, ids, out=view)
        except BaseException:
            host.abort(block_hash)
            raise
        host.commit(block_hash)
        self.offloaded += 1
