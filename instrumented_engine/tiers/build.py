"""Building an engine's tiers from a `TierConfig`: the stores and the workers between them.

    host pool (HostKVPool)        the host tier; also the remote reads' staging when present
    remote (ResilientRemote)      the remote store (opened from the URL, or the one given),
                                  behind fault injection when asked, deadlines and a breaker
    staging                       a host pool for remote reads when there is no host tier
    write-behind (WriteBehind)    new full blocks to host (write-through) and remote
    prefetcher (Prefetcher)       remote → staging reads, started at arrival
    offload (EvictionOffload)     device evictions to host (host_write="evict")

`TierFlow` moves requests through them; this module only builds them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from instrumented_engine.tiers.config import TierConfig
from instrumented_engine.tiers.faults import FaultyRemote
from instrumented_engine.tiers.format import BlockLayout
from instrumented_engine.tiers.host import HostKVPool
from instrumented_engine.tiers.offload import EvictionOffload
from instrumented_engine.tiers.prefetch import Prefetcher
from instrumented_engine.tiers.remote import ResilientRemote
from instrumented_engine.tiers.stores import RemoteStore, open_remote
from instrumented_engine.tiers.writeback import WriteBehind


@dataclass(slots=True)
class TierStack:
    """An engine's tiers (each None when the config leaves it out)."""

    layout: BlockLayout
    host: HostKVPool | None
    remote: ResilientRemote | None
    staging: HostKVPool | None
    writer: WriteBehind | None
    prefetcher: Prefetcher | None
    offload: EvictionOffload | None


def build_tiers(config: TierConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *,
                recorder: Any, store: RemoteStore | None = None, clock: Any = None,
                on_read_done: Any = None, offload_ids: Any = None) -> TierStack:
    """The tiers of `config` around the device cache `kv_caches`.

    Args:
        config: the tiers.
        kv_caches: the engine's per-layer (k, v) device cache (fixes the block layout).
        recorder: an agent.telemetry.Recorder for the tiers' activity spans and events, or
            None.
        store: the raw store behind `config.remote`, already opened (the caller checked it
            once); None opens `config.remote` here.
        clock: monotonic ns (the engine's); default `time.monotonic_ns`.
        on_read_done: called when a remote prefetch finishes (wakes the engine loop).
        offload_ids: for layer groups with pools of their own, (block id, digest) → block id
            per layer of an evicted position (`EvictionOffload`'s `ids_of`).
    """
    layout = BlockLayout.from_kv_caches(kv_caches)
    host = (HostKVPool(layout, config.host_blocks, recorder=recorder)
            if config.host_blocks else None)
    remote: ResilientRemote | None = None
    if config.remote is not None:
        raw = (store if store is not None
               else open_remote(config.remote, timeout_s=config.resilience.timeout_s))
        wrapped = (FaultyRemote(raw, config.faults, recorder=recorder)
                   if config.faults.active else raw)
        remote = ResilientRemote(wrapped, layout, config.resilience, key=config.remote_key,
                                 recorder=recorder)
    staging = host
    if staging is None and remote is not None:
        staging = HostKVPool(layout, config.staging_blocks)
    through = host is not None and config.host_write == "through"
    writer = (WriteBehind(host if through else None, remote,
                          capacity=config.writeback_capacity)
              if through or remote is not None else None)
    prefetcher = None
    if remote is not None:
        assert staging is not None
        prefetcher = Prefetcher(remote, staging, config.prefetch_workers, recorder=recorder,
                                clock=clock or time.monotonic_ns, on_done=on_read_done)
    offload = (EvictionOffload(host, kv_caches, offload_ids)
               if host is not None and config.host_write == "evict" else None)
    return TierStack(layout, host, remote, staging, writer, prefetcher, offload)
