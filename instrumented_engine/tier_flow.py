"""The host and remote tiers in the engine's request flow (DESIGN.md section 2, the tiers issue).

    arrival (any thread)   lookup device → host → remote along the chain: promised hits;
                           remote hits start their prefetch into host staging at once
                           (instrumented_engine.tier_prefetch: hidden load time while the
                           request waits in `queue`; a `remote_read` activity span)
    admission (scheduler)  `remote_read` state while the prefetch is still running; then the
                           longest contiguous prefix found in staging is re-validated (acquired)
                           and copied into the request's fresh device blocks: `h2d` state
    before the forward     `sync` state while an asynchronous (CUDA) copy has not finished
    after the step         new full blocks go to the write-behind queue (host and/or remote)
    device eviction        the evicted block is saved to the host tier (`host_write="evict"`)

Failures never fail a request: a promised block that cannot be used (evicted from staging,
remote timeout, error, checksum, open breaker) is recomputed and counted in
`load_failed_<reason>_tokens`. Tokens of a promise that are unusable because an earlier block
of the chain failed are counted under that earlier block's reason (the chain broke there).

Request states are recorded on the engine loop's thread only. Off it: `arrival` (the submitting
thread; it records nothing itself) and the activity spans the tier backends record from their
worker threads (the recorder accepts those from any thread).
"""

from __future__ import annotations

from typing import Any

import torch

from agent.schema import LOAD_FAIL_REASONS, REMOTE_OP_OUTCOMES, REMOTE_OPS, STATE_CODE
from instrumented_engine.core.block_hash import BlockHash
from instrumented_engine.core.request import Request
from instrumented_engine.h2d import H2DCopier, H2DCopy
from instrumented_engine.tier_prefetch import HOST_WRITES, Plan, Prefetcher, TierConfig
from instrumented_engine.tiers import (
    BlockLayout,
    FaultyRemote,
    HostKVPool,
    HostPoolFull,
    RemoteStore,
    ResilientRemote,
    WriteBehind,
    gather_block,
    open_remote,
)

__all__ = ["HOST_WRITES", "TierConfig", "TierFlow"]

QUEUE = STATE_CODE["queue"]
REMOTE_READ = STATE_CODE["remote_read"]
H2D = STATE_CODE["h2d"]
SYNC = STATE_CODE["sync"]
PREFILL = STATE_CODE["prefill"]
_POOL_STATES = ("in_use", "cached_free", "empty")
REMOTE_OPS_TOTAL = "kvscope_remote_operations_total"
#: Its (op, outcome) series: only reads check objects, so only they can end in `checksum`.
REMOTE_OP_SERIES = tuple((op, o) for op in REMOTE_OPS for o in REMOTE_OP_OUTCOMES
                         if o != "checksum" or op == "read")


class TierFlow:
    """Host and remote tiers of one engine, wired into its arrival, admission and steps.

    Args:
        config: the tiers.
        kv_caches: the engine's device cache (per layer (k, v)).
        recorder: an agent.telemetry.Recorder, or None.
        model: the `model` label of tier metrics.
        clock: monotonic ns (the recorder's).
        store: a raw remote store to use instead of opening `config.remote` (embedding,
            tests); faults and resilience still wrap it.
    """

    def __init__(self, config: TierConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 *, recorder: Any, model: str, clock: Any,
                 store: RemoteStore | None = None) -> None:
        self.config = config
        self.kv_caches = kv_caches
        self.rec = recorder
        self.model = model
        self.clock = clock
        self.layout = layout = BlockLayout.from_kv_caches(kv_caches)
        self.bs = layout.block_size
        self.host: HostKVPool | None = (HostKVPool(layout, config.host_blocks, recorder=recorder)
                                        if config.host_blocks else None)
        self.remote: ResilientRemote | None = None
        if config.remote is not None:
            raw = (store if store is not None
                   else open_remote(config.remote, timeout_s=config.resilience.timeout_s))
            wrapped = (FaultyRemote(raw, config.faults, recorder=recorder)
                       if config.faults.active else raw)
            self.remote = ResilientRemote(wrapped, layout, config.resilience, recorder=recorder,
                                          model=model)
        self.staging: HostKVPool | None = self.host
        if self.staging is None and self.remote is not None:
            self.staging = HostKVPool(layout, config.staging_blocks)
        through = self.host is not None and config.host_write == "through"
        self.writer: WriteBehind | None = None
        if through or self.remote is not None:
            self.writer = WriteBehind(self.host if through else None, self.remote,
                                      capacity=config.writeback_capacity)
        self.prefetcher: Prefetcher | None = None
        if self.remote is not None:
            assert self.staging is not None
            self.prefetcher = Prefetcher(self.remote, self.staging, config.prefetch_workers,
                                         recorder=recorder)
        self.copier = H2DCopier(kv_caches, clock=clock)
        self._closed = False
        self.offloaded = 0
        self.offload_skipped = 0
        self._published_ops: dict[tuple[str, str], int] | None = None
        self._publish_remote_ops()  # the zero baseline, before the first operation

    @property
    def lookup_tiers(self) -> tuple[Any, ...]:
        """The `KVTier`s the arrival lookup asks, in chain order."""
        return tuple(t for t in (self.host, self.remote) if t is not None)

    def _tid(self) -> int:
        return -1 if self.rec is None else self.rec.new_transfer_id()

    def _stage(self, req: Request, state: int, t: int) -> None:
        # NOTE: after its first token a request stays in `decode` (a re-admission after a
        # preemption may still load blocks: that shows as activity, not as TTFT stages).
        if req.has_first_token:
            return
        if self.rec is not None:
            self.rec.stage(req.request_num, state, t)
        req.state = state

    # ------------------------------------------------------------------ arrival
    def prefetches(self, promised: dict[str, int]) -> bool:
        """Whether `arrival` would start a remote prefetch for this promise."""
        return self.prefetcher is not None and promised.get("remote", 0) >= self.bs

    def arrival(self, req: Request, promised: dict[str, int]) -> None:
        """(Any thread: the submitting one, once the request has its `request_num`) remember
        the promise and start the prefetch of its remote hits. Records no request state."""
        bs = self.bs
        plan = Plan(promised.get("device", 0) // bs, promised.get("host", 0) // bs,
                    promised.get("remote", 0) // bs)
        req.tier = plan
        if plan.promised_remote and self.prefetcher is not None:
            self.prefetcher.start(req, plan)

    # ------------------------------------------------------------------ admission
    def prepare(self, req: Request, num_hit_blocks: int) -> int:
        """(Scheduler, at admission) blocks after the device hits that can be loaded now.

        Waits for the request's prefetch (its `remote_read` state), then acquires the longest
        contiguous run of blocks in staging: they stay acquired until `admitted` copied them or
        `cancel` gave them back.
        """
        plan: Plan | None = req.tier
        if plan is None or self.staging is None:
            return 0
        self._finish_prefetch(req, plan)
        limit = (req.num_tokens - 1) // self.bs
        staging = self.staging
        for h in req.block_hashes[num_hit_blocks:limit]:
            view = staging.acquire(h)
            if view is None:
                break
            plan.views.append(h)
            plan.payloads.append(view)
        return len(plan.views)

    def _finish_prefetch(self, req: Request, plan: Plan) -> None:
        if not plan.reads:
            return
        if Prefetcher.pending(plan):
            plan.waited = True
            self._stage(req, REMOTE_READ, self.clock())
            if self.rec is not None and not req.has_first_token:
                for r in plan.reads:
                    self.rec.wait_for(req.request_num, r.transfer_id)
        Prefetcher.settle(req, plan)
        if req.state == REMOTE_READ:
            self._stage(req, QUEUE, self.clock())

    def cancel(self, req: Request) -> None:
        """(Scheduler) the request was not admitted after `prepare`: release its blocks."""
        plan: Plan | None = req.tier
        if plan is None or self.staging is None:
            return
        plan.waited = False
        for h in plan.views:
            self.staging.release(h)
        plan.views = []
        plan.payloads = []

    def admitted(self, req: Request, num_hit_blocks: int) -> None:
        """(Scheduler, after allocation) copy the prepared blocks into the request's fresh
        device blocks (its `h2d` state) and settle its accounting for this admission."""
        plan: Plan | None = req.tier
        if plan is None:
            return
        n = len(plan.views)
        if n:
            assert self.staging is not None
            dest = [b.block_id for b in req.blocks[num_hit_blocks:num_hit_blocks + n]]
            self._copy(req, plan, dest)
        elif plan.waited and req.state == QUEUE:
            # Back in `queue` after its remote_read, later than the step's start: it enters
            # `prefill` now (the engine's step-start transition would go back in time).
            self._stage(req, PREFILL, self.clock())
        plan.waited = False
        if not req.has_first_token:
            self._account(req, plan, num_hit_blocks, n)
        plan.stored = max(plan.stored, num_hit_blocks + n)

    def _copy(self, req: Request, plan: Plan, dest: list[int]) -> None:
        assert self.staging is not None
        t0 = self.clock()
        self._stage(req, H2D, t0)
        tid = plan.h2d_transfer = self._tid()
        if self.rec is not None and not req.has_first_token:
            self.rec.wait_for(req.request_num, tid)
        copy = self.copier.copy(plan.payloads, dest)
        t1 = copy.issue_end_ns
        n = len(dest)
        if self.rec is not None:
            self.rec.activity("h2d", t0, t1, request_num=req.request_num, tier="host",
                              tokens=n * self.bs, nbytes=n * self.layout.payload_bytes,
                              transfer_id=tid)
        self._stage(req, PREFILL, t1)
        if copy.pending:
            plan.copy = copy
        else:
            self._copied(plan, copy)

    def _copied(self, plan: Plan, copy: H2DCopy) -> None:
        assert self.staging is not None
        for h in plan.views:
            self.staging.release(h)
        plan.views = []
        plan.payloads = []
        plan.layer_load_ns = copy.load_ns
        plan.layer_wait_ns = copy.wait_ns
        plan.copy = None

    def _account(self, req: Request, plan: Plan, hit: int, n: int) -> None:
        """Assign (not add: each admission before the first token starts over) the request's
        loaded, failed and byte counts."""
        a = req.acct
        bs = self.bs
        lo, hi = plan.remote_lo, plan.remote_hi
        st = plan.statuses
        if self.host is None:
            remote = n  # staging only ever holds remote blocks
        else:
            remote = sum(1 for i in range(hit, hit + n)
                         if lo <= i < hi and st is not None and st[i - lo] is None)
        a.remote_loaded_tokens = remote * bs
        a.host_loaded_tokens = (n - remote) * bs
        pb = self.layout.payload_bytes
        a.h2d_bytes = a.host_read_bytes = n * pb
        a.remote_read_bytes = plan.remote_nbytes
        a.host_written_bytes = plan.staged_blocks * pb
        used = hit + n
        first = max(used, plan.promised_dev)
        failed = max(0, hi - first)
        for r in LOAD_FAIL_REASONS:
            setattr(a, f"load_failed_{r}_tokens", 0)
        a.load_failed_tokens = failed * bs
        if failed:
            reason = "evicted"
            if lo <= used < hi and st is not None and st[used - lo] is not None:
                reason = st[used - lo]
            setattr(a, f"load_failed_{reason}_tokens", failed * bs)

    # ------------------------------------------------------------------ the step
    def before_forward(self, reqs: list[Request]) -> None:
        """(Engine, before the forward) the `sync` wait for copies still in flight."""
        for req in reqs:
            plan: Plan | None = req.tier
            if plan is None or plan.copy is None:
                continue
            self._stage(req, SYNC, self.clock())
            if self.rec is not None and not req.has_first_token:
                self.rec.wait_for(req.request_num, plan.h2d_transfer)
            copy = plan.copy
            self.copier.wait(copy)
            self._copied(plan, copy)
            self._stage(req, PREFILL, self.clock())

    def after_step(self, reqs: list[Request], num_new: list[int]) -> None:
        """(Engine, after the forward, before finished requests free their blocks) hand the
        blocks the step completed to the write-behind."""
        writer = self.writer
        if writer is None:
            return
        pb, ob = self.layout.payload_bytes, self.layout.object_bytes
        for req, n in zip(reqs, num_new, strict=True):
            plan: Plan | None = req.tier
            if plan is None:
                continue
            full = min((req.num_computed_tokens + n) // self.bs, len(req.block_hashes),
                       len(req.blocks))
            for i in range(plan.stored, full):
                payload = gather_block(self.kv_caches, req.blocks[i].block_id)
                if writer.submit(req.block_hashes[i], req.namespace, payload):
                    if writer.host is not None:
                        req.acct.host_written_bytes += pb
                    if writer.remote is not None:
                        req.acct.remote_written_bytes += ob
            plan.stored = max(plan.stored, full)

    def record_pools(self, t: int) -> None:
        """(Engine, each step) host pool occupancy as samples and block-pool gauges (states:
        in_use = slots being filled, cached_free = indexed, empty = free); the remote
        operation counters."""
        rec = self.rec
        if rec is None:
            return
        self._publish_remote_ops()
        if self.host is None:
            return
        for state, v in zip(_POOL_STATES, self.host.state_counts(), strict=True):
            rec.sample("pool", state, v, entity="host", unit="blocks", t=t)
            rec.set_gauge("kvscope_block_pool_blocks", v, (self.model, "host", state))

    def _publish_remote_ops(self) -> None:
        """(Engine loop only) `kvscope_remote_operations_total` from the remote's cumulative
        outcome counts. The workers count; only this thread publishes, as absolute values, so
        the live counter never goes backwards. Every (op, outcome) is published from the first
        step on, zeros included, so a rate over the first failures sees them."""
        rec, remote = self.rec, self.remote
        if rec is None or remote is None:
            return
        counts = remote.stats.outcome_counts()
        if counts == self._published_ops:
            return
        self._published_ops = counts
        for op, outcome in REMOTE_OP_SERIES:
            rec.set_counter(REMOTE_OPS_TOTAL, counts.get((op, outcome), 0),
                            (self.model, op, outcome))

    def _record_stats(self) -> None:
        """Counters of the tier components as samples at the end (source `pool`, entity the
        component): ops, failures by reason, bytes, late completions, write-behind skips."""
        rec = self.rec
        if rec is None:
            return
        t = self.clock()
        parts: list[tuple[str, Any]] = [("host", self.host), ("remote", self.remote),
                                        ("writeback", self.writer)]
        if self.staging is not self.host:
            parts.append(("staging", self.staging))
        for entity, comp in parts:
            if comp is None:
                continue
            snap = comp.stats.snapshot()
            for kind in ("ops", "failures", "counters"):
                for name, v in snap[kind].items():
                    metric = name if kind == "counters" else f"{kind}_{name}"
                    rec.sample("pool", metric, v, entity=entity, t=t)
        rec.sample("pool", "offloaded_blocks", self.offloaded, entity="host", t=t)
        rec.sample("pool", "offload_skipped_blocks", self.offload_skipped, entity="host", t=t)

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """(BlockPool) save a device block to the host tier before it is reused."""
        host = self.host
        if host is None or self.config.host_write != "evict" or block_hash in host:
            return
        try:
            view, _ = host.reserve(block_hash)
        except (HostPoolFull, KeyError):
            self.offload_skipped += 1
            return
        try:
            gather_block(self.kv_caches, block_id, out=view)
        except BaseException:
            host.abort(block_hash)
            raise
        host.commit(block_hash)
        self.offloaded += 1

    def layer_times(self, req: Request, layer: int) -> tuple[int, int]:
        """(load_ns, wait_ns) of `layer` for the request's latest copy (0, 0 without one)."""
        plan: Plan | None = req.tier
        if plan is None or layer >= len(plan.layer_load_ns):
            return 0, 0
        return plan.layer_load_ns[layer], plan.layer_wait_ns[layer]

    def release(self, req: Request) -> None:
        """(Engine) the request ended: give back whatever it still holds."""
        plan: Plan | None = req.tier
        if plan is None:
            return
        if plan.copy is not None:
            self.copier.wait(plan.copy)
            self._copied(plan, plan.copy)
        self.cancel(req)

    def flush(self) -> None:
        """Wait for queued writes (e.g. before a second run reads the remote tier)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Flush writes, record the components' counters, stop the workers, close the
        remote store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.writer is not None:
            self.writer.close()
        self._publish_remote_ops()  # the writes the close just flushed
        self._record_stats()
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.remote is not None:
            self.remote.close()
