"""KV tiers beyond the device pool: the host block pool and the remote store (file or Redis),
with the failure machinery (timeouts, retries, circuit breaker, fault injection) and the
write-behind queue.

Modules: `format` (block object header + payload), `host` (HostKVPool), `remote` (RemoteStore,
open_remote), `file_store`, `redis_store`, `resilient` (ResilientRemote), `breaker`, `faults`,
`staging` (remote → host prefetch), `writeback` (WriteBehind), `stats` (plain counters).
Importing this package does not import redis: `open_remote` loads the backend it needs.

The engine uses them through instrumented_engine.tier_flow.TierFlow (`LLMEngine(tier_config=
TierConfig(...))`, `kvscope run --host-blocks N --remote URL --fault ...`). Its building blocks
(one engine, one layout)::

    layout = BlockLayout.from_kv_caches(runner.kv_caches)
    host = HostKVPool(layout, host_blocks, recorder=rec)              # KVTier "host"
    raw = open_remote(url)                                            # file:// or redis://
    spec = parse_faults(fault_flags, seed)                            # --fault, repeatable
    store = FaultyRemote(raw, spec, recorder=rec) if spec.active else raw
    remote = ResilientRemote(store, layout, ResilienceConfig(), recorder=rec,
                             model=model_id)                          # KVTier "remote"
    writer = WriteBehind(host, remote, capacity=256)

    # arrival (any thread): promised hits, after the device's n_dev blocks
    n_host = host.lookup(hashes, n_dev); n_rem = remote.lookup(hashes, n_dev + n_host)
    # prefetch / admission: remote → host staging (statuses per block, None = loaded)
    res = prefetch_into_host(remote, host, hashes[a:b], req.namespace, transfer_id=tid)
    # H2D: view = host.acquire(h); scatter_layer(kv_caches, block_id, view, layer); release(h)
    # new full block: writer.submit(h, req.namespace, gather_block(kv_caches, block_id))

Failed blocks carry their reason (agent.schema.LOAD_FAIL_REASONS) for load_failed_*_tokens.
"""

from __future__ import annotations

from instrumented_engine.tiers.breaker import BreakerConfig, CircuitBreaker
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
from instrumented_engine.tiers.remote import RemoteError, RemoteStore, RemoteTimeout, open_remote
from instrumented_engine.tiers.resilient import ReadResult, ResilienceConfig, ResilientRemote
from instrumented_engine.tiers.staging import prefetch_into_host
from instrumented_engine.tiers.writeback import WriteBehind

__all__ = [
    "BlockLayout", "BreakerConfig", "CircuitBreaker", "CorruptObject", "FaultSpec",
    "FaultyRemote", "HostKVPool", "HostPoolFull", "ReadResult", "RemoteError", "RemoteStore",
    "RemoteTimeout", "ResilienceConfig", "ResilientRemote", "WriteBehind", "decode_into",
    "encode", "gather_block", "open_remote", "parse_faults", "prefetch_into_host",
    "scatter_layer",
]
