"""The host and remote tiers in the engine's request flow (docs/DESIGN.md, "Tiers", "TTFT stages").

    arrival (any thread)   lookup device → host → remote along the chain: promised hits;
                           remote hits start their prefetch into host staging at once
                           (tiers.prefetch: hidden load time while the request waits in
                           `queue`; a `remote_read` activity span)
    admission (scheduler)  `remote_read` state while the prefetch is still running; then the
                           longest contiguous prefix found in staging is re-validated (acquired)
                           and copied into the request's fresh device blocks: `h2d` state
    before the forward     `sync` state while an asynchronous (CUDA) copy has not finished
    after the step         new full blocks go to the write-behind queue (host and/or remote)
    device eviction        the evicted block is saved to the host tier (tiers.offload)

Failures never fail a request: a promised block that cannot be used (evicted from staging,
remote timeout, error, checksum, open breaker) is recomputed and counted in
`load_failed_<reason>_tokens`. Tokens of a promise that are unusable because an earlier block
of the chain failed are counted under that earlier block's reason (the chain broke there).

Request states and accounting go through the engine's `RequestLifecycle`; this module decides
*what* happened (which blocks loaded, which failed, where the bytes came from). Off the engine
loop: `arrival` (the submitting thread; it records nothing itself) and the activity spans the
tier backends record from their worker threads.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import groupby
from typing import Any

import torch

from agent.telemetry import PoolStatus, RemoteStatus
from instrumented_engine.core.request import Request
from instrumented_engine.lifecycle import (
    H2D,
    PREFILL,
    QUEUE,
    REMOTE_READ,
    SYNC,
    Loads,
    RequestLifecycle,
)
from instrumented_engine.tiers.build import TierStack
from instrumented_engine.tiers.config import TierConfig
from instrumented_engine.tiers.format import BlockIds, gather_block
from instrumented_engine.tiers.h2d import H2DCopier, H2DCopy
from instrumented_engine.tiers.plan import TierPlan
from instrumented_engine.tiers.prefetch import Prefetcher


def _block_id(req: Request, i: int) -> int:
    return req.blocks[i].block_id


class TierFlow:
    """Host and remote tiers of one engine, wired into its arrival, admission and steps.

    Args:
        config: the tiers.
        stack: the tiers' stores and workers (`tiers.build.build_tiers`).
        kv_caches: the engine's device cache (per layer (k, v)).
        lifecycle: the engine's request lifecycle (states and accounting).
        recorder: an agent.telemetry.Recorder for transfer ids and spans, or None.
        clock: monotonic ns (the recorder's).
        block_ids: (request, chain position) → the device block(s) holding that position: an
            id for every layer, one per layer (layer groups with pools of their own), or None
            when a group no longer holds it; default `req.blocks[i].block_id`.
    """

    def __init__(self, config: TierConfig, stack: TierStack,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lifecycle: RequestLifecycle,
                 *, recorder: Any, clock: Any,
                 block_ids: Callable[[Request, int], BlockIds | None] | None = None) -> None:
        self.config = config
        self.block_ids = block_ids or _block_id
        self.kv_caches = kv_caches
        self.life = lifecycle
        self.rec = recorder
        self.clock = clock
        self.layout = layout = stack.layout
        self.bs = layout.block_size
        self.host = stack.host
        self.remote = stack.remote
        self.staging = stack.staging
        self.writer = stack.writer
        self.prefetcher = stack.prefetcher
        self.offload = stack.offload
        self.copier = H2DCopier(kv_caches, clock=clock, mode=config.load_mode,
                                nvtx=getattr(recorder, "nvtx", None))
        #: (layer mode) the copies the running forward waits for, layer by layer.
        self._forward_copies: list[tuple[Request, H2DCopy]] = []
        self._closed = False

    @property
    def lookup_tiers(self) -> tuple[Any, ...]:
        """The `KVTier`s the arrival lookup asks, in chain order."""
        return tuple(t for t in (self.host, self.remote) if t is not None)

    def host_evicted(self, digest: bytes) -> bool:
        """Whether the host tier evicted `digest` earlier (so it could not supply it)."""
        return self.host is not None and self.host.was_evicted(digest)

    def _tid(self) -> int:
        return -1 if self.rec is None else self.rec.new_transfer_id()

    # ------------------------------------------------------------------ arrival
    def prefetches(self, promised: dict[str, int]) -> bool:
        """Whether `arrival` would start a remote prefetch for this promise."""
        return self.prefetcher is not None and promised.get("remote", 0) >= self.bs

    def arrival(self, req: Request, promised: dict[str, int]) -> None:
        """(Any thread: the submitting one, once the request has its `request_num`) remember
        the promise and start the prefetch of its remote hits. Records no request state."""
        bs = self.bs
        plan = TierPlan(promised.get("device", 0) // bs, promised.get("host", 0) // bs,
                        promised.get("remote", 0) // bs)
        req.tier = plan
        if plan.promised_remote and self.prefetcher is not None:
            self.prefetcher.start(req, plan)

    # ------------------------------------------------------------------ admission
    def ready(self, req: Request) -> bool:
        """(Scheduler, before admitting `req`; never blocks) whether its remote reads are
        done. A request whose reads are still running is parked in `remote_read` (left out
        of the batch while others are scheduled, as vLLM parks requests in
        WAITING_FOR_REMOTE_KVS) until they finish or their deadline passes; it then goes on
        with what arrived and recomputes the rest (counted as `timeout`)."""
        plan = req.tier
        if plan is None or not plan.reads:
            return True
        life = self.life
        pending = Prefetcher.pending(plan)
        now = self.clock()
        deadline = max((r.deadline_ns for r in pending), default=now)
        if pending and now < deadline:
            if req.state == QUEUE:
                life.enter(req, REMOTE_READ, now)
                for r in plan.reads:
                    if r.transfer_id >= 0:  # a block found staged is no transfer
                        life.waits_on(req, r.transfer_id)
            return False
        if req.state == REMOTE_READ:
            # It waited on the reads up to when the last one ended (or its deadline passed),
            # not up to when the engine loop came back to it.
            end = deadline if pending else Prefetcher.finished_at(plan)
            life.enter(req, QUEUE, min(now, end) if end >= 0 else now)
            plan.waited = True
        self._abandoned(req, Prefetcher.settle(req, plan))
        return True

    def _abandoned(self, req: Request, transfer_ids: list[int]) -> None:
        """Ledger: the request stopped waiting for these reads of its own."""
        if self.rec is not None:
            for tid in transfer_ids:
                self.rec.ledger("abandoned", req.request_num, tier="remote", transfer_id=tid)

    @staticmethod
    def any_ready(reqs: Any) -> bool:
        """Whether a request parked in `remote_read` among `reqs` has all its reads done."""
        return any(req.state == REMOTE_READ and req.tier is not None
                   and not Prefetcher.pending(req.tier) for req in reqs)

    def next_deadline_ns(self, reqs: Any) -> int | None:
        """The earliest read deadline among `reqs` parked in `remote_read` (None if none)."""
        out = None
        for req in reqs:
            plan = req.tier
            if plan is None or req.state != REMOTE_READ:
                continue
            for r in Prefetcher.pending(plan):
                out = r.deadline_ns if out is None else min(out, r.deadline_ns)
        return out

    def prepare(self, req: Request, num_hit_blocks: int) -> int:
        """(Scheduler, at admission, after `ready`) blocks after the device hits that can be
        loaded now: the longest contiguous run of blocks in staging, acquired until `admitted`
        copied them or `cancel` gave them back."""
        plan = req.tier
        if plan is None or self.staging is None:
            return 0
        limit = (req.num_tokens - 1) // self.bs
        staging = self.staging
        for h in req.block_hashes[num_hit_blocks:limit]:
            view = staging.acquire(h)
            if view is None:
                break
            plan.views.append(h)
            plan.payloads.append(view)
        self._unpin(plan)
        return len(plan.views)

    def _unpin(self, plan: TierPlan) -> None:
        """The request holds its own references now (or gives up): its reads' pins go."""
        if self.prefetcher is not None and (plan.held or plan.reads):
            self.prefetcher.unpin(plan.held + plan.reads)
        plan.held = []

    def cancel(self, req: Request) -> None:
        """(Scheduler) the request was not admitted after `prepare`: release its blocks."""
        plan = req.tier
        if plan is None or self.staging is None:
            return
        plan.waited = False
        for h in plan.views:
            self.staging.release(h)
        plan.views = []
        plan.payloads = []

    def admitted(self, req: Request, num_hit_blocks: int) -> None:
        """(Scheduler, after allocation) copy the prepared blocks into
        the request's fresh device blocks (its `h2d` state) and settle its accounting for this
        admission; the admission's ledger rows record what each block was."""
        plan = req.tier
        if plan is None:
            return
        t = self.clock()
        n = len(plan.views)
        tid = -1
        if n:
            assert self.staging is not None
            ids = self.block_ids
            dest = [ids(req, i) for i in range(num_hit_blocks, num_hit_blocks + n)]
            assert None not in dest, "a loaded position without a device block"
            tid = self._copy(req, plan, dest)  # type: ignore[arg-type]
        elif plan.waited and req.state == QUEUE:
            # Back in `queue` after its remote_read, maybe later than the step's start: it
            # enters `prefill` now (the engine's step-start transition could go back in time).
            self.life.enter(req, PREFILL)
        plan.waited = False
        self._ledger(req, plan, num_hit_blocks, n, t, tid)
        self.life.loaded(req, self._loads(plan, num_hit_blocks, n))
        plan.stored = max(plan.stored, num_hit_blocks + n)

    def _copy(self, req: Request, plan: TierPlan, dest: list[BlockIds]) -> int:
        """Issue the H2D copy; returns its transfer id."""
        assert self.staging is not None
        life = self.life
        t0 = self.clock()
        life.enter(req, H2D, t0)
        tid = plan.h2d_transfer = self._tid()
        life.waits_on(req, tid)
        copy = self.copier.copy(plan.payloads, dest, request_num=req.request_num)
        t1 = copy.issue_end_ns
        if copy.done is None:  # else the copy worker's span, once it has run (`_copied`)
            self._h2d_span(req.request_num, tid, copy.nblocks, t0, t1)
        life.enter(req, PREFILL, t1)
        if copy.pending:
            plan.copy = copy
        else:
            self._copied(plan, copy)
        return tid

    def _copied(self, plan: TierPlan, copy: H2DCopy) -> None:
        """The copy is over (waited for if it still ran): its per-layer times are final and
        its staging slots go back."""
        assert self.staging is not None
        worker = copy.done is not None
        self.copier.finish(copy)
        if worker:
            self._h2d_span(copy.request_num, plan.h2d_transfer, copy.nblocks,
                           copy.work_start_ns, copy.work_end_ns)
        for h in plan.views:
            self.staging.release(h)
        plan.views = []
        plan.payloads = []
        plan.layer_load_ns = copy.load_ns
        plan.layer_wait_ns = copy.wait_ns
        plan.copy = None

    def _h2d_span(self, request_num: int, tid: int, n: int, t0: int, t1: int) -> None:
        if self.rec is not None:
            self.rec.activity("h2d", t0, t1, request_num=request_num, tier="host",
                              tokens=n * self.bs, nbytes=n * self.layout.payload_bytes,
                              transfer_id=tid)

    def _origin(self, plan: TierPlan, i: int) -> str:
        """The tier chain position `i`, copied at admission, came from: the remote when it lies
        in the remote promise and the read the request waited for brought it; else the host
        pool (staging only ever holds remote blocks when there is no host tier)."""
        if self.host is None:
            return "remote"
        lo, hi, st = plan.remote_lo, plan.remote_hi, plan.statuses
        return ("remote" if lo <= i < hi and st is not None and st[i - lo] is None
                else "host")

    def _failure(self, plan: TierPlan, used: int) -> tuple[int, str]:
        """Promised blocks this admission could not use (from where the chain stopped to the
        end of the promise) and the reason of the block where it stopped."""
        lo, hi, st = plan.remote_lo, plan.remote_hi, plan.statuses
        failed = max(0, hi - max(used, plan.promised_dev))
        reason = "evicted"
        if failed and lo <= used < hi and st is not None and st[used - lo] is not None:
            reason = st[used - lo]
        return failed, reason

    def _loads(self, plan: TierPlan, hit: int, n: int) -> Loads:
        """What this admission loaded: `n` blocks copied after `hit` device hits.

        Promised (planned by this admission): the arrival's host and remote promises beyond
        the device hits found at admission. Found: copied blocks outside their tier's promise.
        """
        bs = self.bs
        pd, lo, hi = plan.promised_dev, plan.remote_lo, plan.remote_hi
        remote = sum(1 for i in range(hit, hit + n) if self._origin(plan, i) == "remote")
        host = n - remote
        # Host blocks copied from inside the host promise (what is left of it after the device
        # hits); the others were found there.
        host_in_range = max(0, min(hit + n, lo) - max(hit, pd)) if self.host is not None else 0
        remote_in_range = sum(1 for i in range(max(hit, lo), min(hit + n, hi))
                              if self._origin(plan, i) == "remote")
        failed, reason = self._failure(plan, hit + n)
        pb = self.layout.payload_bytes
        new_remote = plan.remote_nbytes - plan.booked_nbytes
        new_staged = plan.staged_blocks - plan.booked_staged
        plan.booked_nbytes, plan.booked_staged = plan.remote_nbytes, plan.staged_blocks
        return Loads(host_hit_tokens=max(0, lo - max(hit, pd)) * bs,
                     remote_hit_tokens=max(0, hi - max(hit, lo)) * bs,
                     host_found_tokens=(host - host_in_range) * bs,
                     remote_found_tokens=(remote - remote_in_range) * bs,
                     host_loaded_tokens=host * bs, remote_loaded_tokens=remote * bs,
                     failed_tokens=failed * bs, failed_reason=reason,
                     host_read_bytes=host * pb, remote_read_bytes=new_remote,
                     h2d_bytes=n * pb, host_written_bytes=new_staged * pb)

    def _ledger(self, req: Request, plan: TierPlan, hit: int, n: int, t: int, tid: int) -> None:
        """The admission's ledger, block by block: each copied block under the tier it came
        from (runs of one tier become one row, with the bytes read from the host
        pool), and the promised blocks it could not use, per tier, under the reason of the
        block where the chain broke."""
        rec = self.rec
        if rec is None:
            return
        rn, bs, pb = req.request_num, self.bs, self.layout.payload_bytes
        # The admission's rows in one recorder call, in the order `ledger` would record them.
        rows: list[tuple[str, int, int | None, str | None, int, int, int, int, int]] = []
        if n:
            # `_origin` of each block, inlined: its runs are the rows.
            if self.host is None:
                runs: list[tuple[str, int]] = [("remote", n)]
            else:
                lo, hi, st = plan.remote_lo, plan.remote_hi, plan.statuses
                tiers = ["remote" if lo <= i < hi and st is not None and st[i - lo] is None
                         else "host" for i in range(hit, hit + n)]
                runs = [(tier, len(list(g))) for tier, g in groupby(tiers)]
            start = hit
            for tier, k in runs:
                rows.append(("load", rn, t, tier, k * bs, k * pb if tier == "host" else 0,
                             start, tid, -1))
                start += k
        failed, reason = self._failure(plan, hit + n)
        if failed:
            first = max(hit + n, plan.promised_dev)
            lo, hi = plan.remote_lo, plan.remote_hi
            for tier, a, b in (("host", first, min(lo, hi)), ("remote", max(first, lo), hi)):
                if b > a:
                    rows.append((f"failed_{reason}", rn, t, tier, (b - a) * bs, -1, a, -1, -1))
        if rows:
            rec.ledgers(rows)

    # ------------------------------------------------------------------ the step
    def before_forward(self, reqs: list[Request]) -> Callable[[int], None] | None:
        """(Engine, before the forward) in ``whole`` mode, the `sync` wait for copies still in
        flight; in ``layer`` mode, the hook the forward calls before each layer (None when no
        copy of this batch is still running): each layer waits only for its own copies."""
        life = self.life
        pending = [(req, req.tier.copy) for req in reqs
                   if req.tier is not None and req.tier.copy is not None]
        if not pending:
            return None
        if self.copier.layerwise:
            self._forward_copies = pending
            return self._layer_ready
        for req, copy in pending:
            life.enter(req, SYNC)
            life.waits_on(req, req.tier.h2d_transfer)
            self.copier.wait(copy)
            self._copied(req.tier, copy)
            life.enter(req, PREFILL)
        return None

    def _layer_ready(self, layer: int) -> None:
        """(In the forward, before `layer` touches the KV cache) wait for that layer of the
        batch's running copies; a blocked wait is the request's `sync` state."""
        life = self.life
        for req, copy in self._forward_copies:
            waited = self.copier.wait_layer(copy, layer)
            if waited is not None:
                t0, t1 = waited
                life.enter(req, SYNC, t0)
                life.waits_on(req, req.tier.h2d_transfer)
                life.enter(req, PREFILL, t1)

    def after_step(self, reqs: list[Request], num_new: list[int]) -> None:
        """(Engine, after the forward, before finished requests free their blocks) finish
        the step's layer-wise copies (every layer was waited for) and hand the blocks the step
        completed to the write-behind."""
        if self._forward_copies:
            for req, copy in self._forward_copies:
                if req.tier is not None and req.tier.copy is copy:
                    self._copied(req.tier, copy)
            self._forward_copies = []
        writer = self.writer
        if writer is None:
            return
        pb, ob = self.layout.payload_bytes, self.layout.object_bytes
        rec = self.rec
        # The step's `write` ledger rows, recorded in one call after the loop (nothing in it
        # records on this thread, so they keep their order).
        rows: list[tuple[str, int, int | None, str | None, int, int, int, int, int]] = []
        for req, n in zip(reqs, num_new, strict=True):
            plan = req.tier
            if plan is None:
                continue
            full = min((req.num_computed_tokens + n) // self.bs, len(req.block_hashes),
                       len(req.blocks))
            queued = 0
            for i in range(plan.stored, full):
                ids = self.block_ids(req, i)
                if ids is None:  # a window group freed it already: no whole object to write
                    continue
                payload = gather_block(self.kv_caches, ids)
                if writer.submit(req.block_hashes[i], req.namespace, payload):
                    queued += 1
                    self.life.wrote(req, host_bytes=pb if writer.host is not None else 0,
                                    remote_bytes=ob if writer.remote is not None else 0)
            if queued and rec is not None:
                for tier, nbytes, on in (("host", pb, writer.host), ("remote", ob, writer.remote)):
                    if on is not None:
                        rows.append(("write", req.request_num, None, tier, queued * self.bs,
                                     queued * nbytes, plan.stored, -1, -1))
            plan.stored = max(plan.stored, full)
        if rows:
            rec.ledgers(rows)

    # ------------------------------------------------------------------ status
    def host_pool(self) -> PoolStatus | None:
        """The host tier's occupancy (in_use = slots being filled, cached_free = indexed,
        empty = free), or None without a host tier."""
        if self.host is None:
            return None
        return PoolStatus("host", *self.host.state_counts())

    def remote_status(self) -> RemoteStatus | None:
        """The remote tier's breaker state and operation outcomes, or None without one."""
        remote = self.remote
        if remote is None:
            return None
        return RemoteStatus(remote.breaker_states(), remote.stats.outcome_counts(),
                            remote.breaker_open_ns())

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
        off = self.offload
        rec.sample("pool", "offloaded_blocks", off.offloaded if off else 0, entity="host", t=t)
        rec.sample("pool", "offload_skipped_blocks", off.skipped if off else 0, entity="host",
                   t=t)

    def layer_times(self, req: Request, layer: int) -> tuple[int, int]:
        """(load_ns, wait_ns) of `layer` for the request's latest copy (0, 0 without one)."""
        plan = req.tier
        if plan is None or layer >= len(plan.layer_load_ns):
            return 0, 0
        return plan.layer_load_ns[layer], plan.layer_wait_ns[layer]

    def release(self, req: Request) -> None:
        """(Engine) the request ended: give back whatever it still holds."""
        plan = req.tier
        if plan is None:
            return
        if plan.copy is not None:
            self._copied(plan, plan.copy)
        if plan.reads:  # never admitted: its own reads are nobody's
            self._abandoned(req, [r.transfer_id for r in plan.reads
                                  if r.request_num == req.request_num])
        self._unpin(plan)
        plan.reads = []
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
        self._record_stats()
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.copier.close()
        if self.remote is not None:
            self.remote.close()
