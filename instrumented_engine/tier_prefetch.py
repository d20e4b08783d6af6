"""The tiers' configuration and the arrival side of the tier flow (DESIGN.md section 2).

    arrival (submitting thread)  the lookup promised remote hits: their prefetch into host
                                 staging starts now, while the request still has to reach the
                                 engine loop and wait for admission (hidden load time: `queue`
                                 in the partition, a `remote_read` activity span)
    admission (engine loop)      `settle` collects the reads the request depends on

A block is never read twice at once (two reads of one digest would race for its staging slot):
a request whose promised block another request is already reading waits for that read instead.
The in-flight index is shared by the submitting threads and the engine loop, under one lock.
No request state is recorded here: only the remote tier's activity spans, from the workers.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from instrumented_engine.core.block_hash import BlockHash
from instrumented_engine.core.request import Request
from instrumented_engine.h2d import H2DCopy
from instrumented_engine.tiers import (
    FaultSpec,
    HostKVPool,
    ReadResult,
    ResilienceConfig,
    ResilientRemote,
    prefetch_into_host,
)

log = logging.getLogger(__name__)

HOST_WRITES = ("evict", "through")


@dataclass(slots=True, frozen=True)
class TierConfig:
    """The tiers beyond the device pool.

    Attributes:
        host_blocks: host tier size in blocks (0: no host tier).
        remote: `file://DIR` or `redis://HOST:PORT/DB` (None: no remote tier).
        host_write: how blocks reach the host tier: `evict` (device evictions are saved) or
            `through` (every new full block is written behind).
        staging_blocks: host staging for remote reads when there is no host tier (>= 1).
        writeback_capacity: write-behind queue bound in blocks (>= 1; when full: skip, count).
        resilience: remote timeouts, retries, breaker.
        faults: injected remote faults (off by default).
        prefetch_workers: threads running prefetches (>= 1).
    """

    host_blocks: int = 0
    remote: str | None = None
    host_write: str = "evict"
    staging_blocks: int = 256
    writeback_capacity: int = 256
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    faults: FaultSpec = field(default_factory=FaultSpec)
    prefetch_workers: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.host_blocks, int) or self.host_blocks < 0:
            raise ValueError(f"tiers.host_blocks: must be an int >= 0, got {self.host_blocks!r}")
        if self.host_write not in HOST_WRITES:
            raise ValueError(f"tiers.host_write: expected one of {', '.join(HOST_WRITES)}, "
                             f"got {self.host_write!r}")
        for name in ("staging_blocks", "writeback_capacity", "prefetch_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"tiers.{name}: must be an int >= 1, got {v!r}")

    @property
    def active(self) -> bool:
        return self.host_blocks > 0 or self.remote is not None


@dataclass(slots=True)
class Read:
    """One prefetch (a `remote_read` transfer) of some blocks into staging."""

    future: Future[ReadResult]
    transfer_id: int
    hashes: list[BlockHash]
    request_num: int


@dataclass(slots=True)
class Plan:
    """One request's tier state, from arrival to its first token."""

    promised_dev: int  # blocks
    promised_host: int
    promised_remote: int
    #: the reads this request waits for: its own and batch-mates' already in flight
    reads: list[Read] = field(default_factory=list)
    statuses: list[str | None] | None = None  # per remote-promised block, once read
    remote_nbytes: int = 0
    staged_blocks: int = 0
    views: list[BlockHash] = field(default_factory=list)  # acquired staging digests
    payloads: list[torch.Tensor] = field(default_factory=list)  # their slots
    copy: H2DCopy | None = None
    h2d_transfer: int = -1
    layer_load_ns: list[int] = field(default_factory=list)
    layer_wait_ns: list[int] = field(default_factory=list)
    stored: int = 0  # blocks handed to the write-behind queue (chain index)
    waited: bool = False  # left `queue` for `remote_read` in this admission attempt

    @property
    def remote_lo(self) -> int:
        return self.promised_dev + self.promised_host

    @property
    def remote_hi(self) -> int:
        return self.remote_lo + self.promised_remote


class Prefetcher:
    """Remote → staging reads, started at arrival and shared by the requests needing a block.

    Args:
        remote: the resilient remote tier.
        staging: the host pool the reads land in.
        workers: threads running reads.
        recorder: an agent.telemetry.Recorder (transfer ids), or None.
    """

    def __init__(self, remote: ResilientRemote, staging: HostKVPool, workers: int, *,
                 recorder: Any) -> None:
        self.remote = remote
        self.staging = staging
        self.rec = recorder
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvscope-prefetch")
        self._inflight: dict[BlockHash, Read] = {}
        self._lock = threading.Lock()
        self._closed = False

    def start(self, req: Request, plan: Plan) -> None:
        """(Any thread, at arrival, after the request got its `request_num`) read the
        promised remote blocks no read in flight covers; list every read the request needs
        in `plan.reads`."""
        hashes = req.block_hashes[plan.remote_lo:plan.remote_hi]
        with self._lock:
            if self._closed:  # a submit racing the engine's close: its promise fails
                return
            inflight = self._inflight
            for h in [h for h, r in inflight.items() if r.future.done()]:
                del inflight[h]
            own: list[BlockHash] = []
            for h in hashes:
                r = inflight.get(h)
                if r is None:
                    own.append(h)
                elif r not in plan.reads:
                    plan.reads.append(r)
            if not own:
                return
            tid = -1 if self.rec is None else self.rec.new_transfer_id()
            # Submitted under the lock: a concurrent arrival must see these blocks in flight.
            fut = self._pool.submit(prefetch_into_host, self.remote, self.staging, own,
                                    req.namespace, transfer_id=tid,
                                    request_num=req.request_num)
            read = Read(fut, tid, own, req.request_num)
            plan.reads.append(read)
            for h in own:
                inflight[h] = read

    @staticmethod
    def pending(plan: Plan) -> bool:
        """Whether a read the request needs is still running."""
        return not all(r.future.done() for r in plan.reads)

    @staticmethod
    def settle(req: Request, plan: Plan) -> None:
        """(Engine loop) wait for the request's reads; fill `plan.statuses` (one per
        remote-promised block) and its own read's byte and block counts."""
        status: dict[BlockHash, str | None] = {}
        for r in plan.reads:
            try:
                res = r.future.result()
                sts = res.statuses
                if r.request_num == req.request_num:
                    plan.remote_nbytes += res.nbytes
                    plan.staged_blocks += res.loaded
            except Exception:  # a bug below us: recompute rather than fail the request
                log.exception("prefetch failed unexpectedly")
                sts = ["error"] * len(r.hashes)
            status.update(zip(r.hashes, sts, strict=True))
        hashes = req.block_hashes[plan.remote_lo:plan.remote_hi]
        plan.statuses = [status.get(h, "error") for h in hashes]
        plan.reads = []

    def close(self) -> None:
        """Refuse new reads and wait for the running ones. Idempotent."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
