"""Continuous batching: FCFS admission by free blocks, a token budget, chunked prefill and
preemption by recompute (vLLM v1's unified scheduler, without priorities or speculation).

Each step first gives running requests their next tokens (one for a decode, the rest of the
prompt, or as much as the budget allows, for a chunked prefill), oldest first. When the pool has
no block for one of them, the newest running request is preempted: its blocks are freed and it
goes back to the head of the waiting queue, to recompute later. Only in a step without
preemptions are waiting requests admitted, in arrival order, while a running slot, budget and
blocks remain (FCFS: an old request that does not fit blocks the younger ones).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from instrumented_engine.config import SchedulerConfig
from instrumented_engine.core.kv_cache_manager import KVCacheManager
from instrumented_engine.core.request import Request, RequestStatus
from instrumented_engine.lifecycle import REMOTE_READ, RequestLifecycle
from instrumented_engine.tiers.protocol import TierLoader


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs.

    Attributes:
        requests: scheduled requests, in batch order.
        num_new_tokens: tokens each computes in this step.
        admitted: requests admitted from the waiting queue in this step (a subset).
        preempted: requests preempted in this step.
        preempted_tokens: tokens each of them lost (computed since its admission).
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    preempted_tokens: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Args:
        cfg: batching limits.
        kv: the KV cache manager (block tables over the device pool).
        lifecycle: told about admissions and preemptions (the requests' accounting).
        loader: the host/remote tiers' admission half (`TierFlow`), or None.
    """

    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, lifecycle: RequestLifecycle,
                 loader: TierLoader | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.life = lifecycle
        self.loader = loader
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and their token counts; allocate their blocks."""
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        chunked = self.cfg.enable_chunked_prefill
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                if not chunked:
                    i += 1
                    continue
                n = budget
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                out.preempted.append(victim)
                out.preempted_tokens.append(self._preempt(victim))
                if victim is req:
                    break
            else:
                self._recached(req)
                out.requests.append(req)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break  # `req` itself was preempted: nothing after it is left running
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        loader = self.loader
        waiting = self.waiting
        # Requests whose remote reads are still running are passed over (not a blocker of
        # younger ones: they wait on the remote, not on admission) and keep their places.
        parked: list[Request] = []
        try:
            while waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
                req = waiting[0]
                if loader is not None and not loader.ready(req):
                    parked.append(waiting.popleft())
                    continue
                # NOTE: the arrival lookup only promised these hits; they are re-validated here
                # (blocks may have been evicted since, or computed since by a batch-mate).
                hits = self.kv.get_computed_blocks(req)
                num_hit = len(hits) * self.kv.block_size
                # Blocks from the host/remote tiers continue the chain; they are held
                # (acquired) from here until copied into the device blocks allocated below.
                num_load = (loader.prepare(req, len(hits)) if loader is not None
                            else 0) * self.kv.block_size
                n = req.num_tokens - num_hit - num_load
                if n > budget:
                    if not self.cfg.enable_chunked_prefill:
                        if loader is not None:
                            loader.cancel(req)
                        return
                    n = budget
                if not self.kv.allocate_slots(req, num_load + n, hits):
                    if loader is not None:
                        loader.cancel(req)
                    return
                recached = self.kv.recached
                waiting.popleft()
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_hit + num_load
                req.admitted_hit_tokens = num_hit + num_load
                self.life.admitted(req, num_hit)
                if loader is not None:
                    loader.admitted(req, len(hits))
                self._recached(req, recached)
                out.requests.append(req)
                out.num_new_tokens.append(n)
                out.admitted.append(req)
                budget -= n
        finally:
            waiting.extendleft(reversed(parked))

    def _recached(self, req: Request, positions: list[int] | None = None) -> None:
        """Blocks the last allocation cached again after the device pool had evicted them:
        loaded back from a tier (positions before the admission's hits + loads end) or
        computed again (the cost of thrash)."""
        positions = self.kv.recached if positions is None else positions
        if not positions:
            return
        bs = self.kv.block_size
        loaded = sum(1 for i in positions if i * bs < req.admitted_hit_tokens)
        loader = self.loader
        host = sum(1 for i in positions if i * bs >= req.admitted_hit_tokens
                   and loader is not None and loader.host_evicted(req.block_hashes[i]))
        self.life.needed_again(req, loaded=loaded, recomputed=len(positions) - loaded,
                               host_evicted=host)

    def parked(self) -> list[Request]:
        """Waiting requests left out of admission because their remote reads are running."""
        return [r for r in self.waiting if r.state == REMOTE_READ]

    def _preempt(self, req: Request) -> int:
        """Free the request's blocks and requeue it at the head; returns the tokens lost."""
        self.kv.free(req)
        # Tokens this request computed since its admission are lost (its full blocks stay
        # cached-free and may be hit again when it is re-admitted, counted as hits then).
        lost = req.num_computed_tokens - req.admitted_hit_tokens
        self.life.preempted(req, lost)
        req.num_computed_tokens = 0
        req.admitted_hit_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        return lost

    def finish(self, req: Request) -> None:
        """Remove a finished request and free its blocks (tail first)."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
