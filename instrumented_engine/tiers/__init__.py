"""The KV tiers beyond the device pool, and how a request moves through them.

    config.py     TierConfig: host size, remote URL, resilience, faults
    build.py      build_tiers(): the stores and workers of a TierConfig (a TierStack)
    flow.py       TierFlow: arrival lookup → prefetch → admission (remote_read, h2d) → sync →
                  write-behind; tells the request lifecycle what happened
    plan.py       TierPlan: one request's promise, reads, held blocks and copy (Request.tier)
    prefetch.py   Prefetcher: remote → host staging reads started at arrival
    h2d.py        H2DCopier: host → device copies, layer by layer, with per-layer timings
    host.py       HostKVPool: the host tier (pinned on CUDA), its own digest index and LRU
    offload.py    EvictionOffload: device evictions saved to the host tier
    writeback.py  WriteBehind: new blocks to host/remote off the critical path
    remote.py     ResilientRemote: deadlines, retries, circuit breaker, failure reasons
    breaker.py    CircuitBreaker
    faults.py     FaultyRemote: injected latency, errors, corruption, outages (--fault)
    format.py     the stored form of one block (header + payload), checks
    stats.py      plain counters of every component (the exporters read them)
    protocol.py   KVTier (arrival half) and TierLoader (admission half) seams
    stores/       raw remote backends: file:// (stores.file), redis:// (stores.redis)

The engine builds all of this from `LLMEngine(tier_config=TierConfig(...))` (`kvscope run
--host-blocks N --remote URL --fault ...`). The building blocks, for one engine::

    stack = build_tiers(TierConfig(host_blocks=64, remote="file:///tmp/kv"), kv_caches,
                        recorder=rec)
    stack.host.lookup(hashes, n_dev)                      # KVTier "host"
    stack.remote.lookup(hashes, n_dev + n_host)           # KVTier "remote"
    prefetch_into_host(stack.remote, stack.staging, hashes[a:b], ns, transfer_id=tid)
    stack.writer.submit(h, ns, gather_block(kv_caches, block_id))

Failed blocks carry their reason (agent.schema.LOAD_FAIL_REASONS) for load_failed_*_tokens.
Importing this package does not import redis: `open_remote` loads the backend it needs.
"""

from __future__ import annotations

from instrumented_engine.tiers.breaker import BreakerConfig, CircuitBreaker
from instrumented_engine.tiers.config import HOST_WRITES, TierConfig
from instrumented_engine.tiers.faults import FaultSpec, FaultyRemote, parse_faults
from instrumented_engine.tiers.format import (
    BlockLayout,
    CorruptObject,
    decode_into,
    encode,
    gather_block,
    scatter_layer,
)
from instrumented_engine.tiers.host import HostKVPool, HostPoolFull
from instrumented_engine.tiers.prefetch import prefetch_into_host
from instrumented_engine.tiers.remote import ReadResult, ResilienceConfig, ResilientRemote
from instrumented_engine.tiers.stores import RemoteError, RemoteStore, RemoteTimeout, open_remote
from instrumented_engine.tiers.writeback import WriteBehind

__all__ = [
    "HOST_WRITES", "BlockLayout", "BreakerConfig", "CircuitBreaker", "CorruptObject",
    "FaultSpec", "FaultyRemote", "HostKVPool", "HostPoolFull", "ReadResult", "RemoteError",
    "RemoteStore", "RemoteTimeout", "ResilienceConfig", "ResilientRemote", "TierConfig",
    "WriteBehind", "decode_into", "encode", "gather_block", "open_remote", "parse_faults",
    "prefetch_into_host", "scatter_layer",
]
