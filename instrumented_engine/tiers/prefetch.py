"""Remote → host staging reads, started at the arrival lookup (docs/DESIGN.md, "TTFT stages").

    arrival (submitting thread)  the lookup promised remote hits: their prefetch into host
                                 staging starts now, while the request still has to reach the
                                 engine loop and wait for admission (hidden load time: `queue`
                                 in the partition, a `remote_read` activity span)
    admission (engine loop)      `settle` collects the reads the request depends on

A block is never read twice at once (two reads of one digest would race for its staging slot):
a request whose promised block another request is already reading waits for that read instead.
The in-flight index is shared by the submitting threads and the engine loop, under one lock.
No request state is recorded here: only the remote tier's activity spans, from the workers.

`prefetch_into_host` is one read: slots are reserved before it and published only for blocks
that loaded; a timed-out read keeps its slots reserved until the late read finishes, so no
other block can be written over them meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from instrumented_engine.core.block_hash import BlockHash
from instrumented_engine.core.request import Request
from instrumented_engine.tiers.host import HostKVPool, HostPoolFull
from instrumented_engine.tiers.plan import Read, TierPlan
from instrumented_engine.tiers.remote import ReadResult, ResilientRemote

log = logging.getLogger(__name__)


class Prefetcher:
    """Remote → staging reads, started at arrival and shared by the requests needing a block.

    Nothing here blocks the engine loop: a read has a deadline (its start plus one remote
    operation deadline); `settle` takes what finished and counts what did not as `timeout`.

    Args:
        remote: the resilient remote tier.
        staging: the host pool the reads land in.
        workers: threads running reads.
        recorder: an agent.telemetry.Recorder (transfer ids), or None.
        clock: monotonic ns (the recorder's).
        on_done: called (on a worker thread) when a read finishes: the engine loop's wake-up.
    """

    def __init__(self, remote: ResilientRemote, staging: HostKVPool, workers: int, *,
                 recorder: Any, clock: Callable[[], int] = time.monotonic_ns,
                 on_done: Callable[[], None] | None = None) -> None:
        self.remote = remote
        self.staging = staging
        self.rec = recorder
        self.clock = clock
        self.on_done = on_done
        self.deadline_ns = int(remote.config.timeout_s * 1e9)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvscope-prefetch")
        self._inflight: dict[BlockHash, Read] = {}
        self._lock = threading.Lock()
        self._closed = False

    def start(self, req: Request, plan: TierPlan) -> None:
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
                    r.users += 1
                    plan.reads.append(r)
            # Blocks already staged (an earlier read brought them) are pinned here, at once:
            # no transfer, nothing to wait for.
            staged = [h for h in own if self.staging.acquire(h) is not None]
            if staged:
                done: Future[ReadResult] = Future()
                done.set_result(ReadResult([None] * len(staged), pinned=staged))
                plan.reads.append(Read(done, -1, staged, req.request_num, self.clock()))
                have = set(staged)
                own = [h for h in own if h not in have]
            if not own:
                return
            tid = -1 if self.rec is None else self.rec.new_transfer_id()
            # Submitted under the lock: a concurrent arrival must see these blocks in flight.
            fut = self._pool.submit(prefetch_into_host, self.remote, self.staging, own,
                                    req.namespace, transfer_id=tid,
                                    request_num=req.request_num)
            read = Read(fut, tid, own, req.request_num, self.clock() + self.deadline_ns)
            plan.reads.append(read)
            for h in own:
                inflight[h] = read
        fut.add_done_callback(self._finished)

    def _finished(self, _fut: Future[ReadResult]) -> None:
        if self.on_done is not None:
            try:
                self.on_done()
            except Exception:  # a wake-up must never fail a read
                log.exception("prefetch completion callback failed")

    @staticmethod
    def pending(plan: TierPlan) -> list[Read]:
        """The reads the request needs that are still running."""
        return [r for r in plan.reads if not r.future.done()]

    @staticmethod
    def finished_at(plan: TierPlan) -> int:
        """When the last of the request's finished reads ended (monotonic ns; -1 if none)."""
        ends = []
        for r in plan.reads:
            if r.future.done() and not r.future.cancelled():
                try:
                    ends.append(r.future.result().end_ns)
                except Exception:
                    continue
        return max(ends, default=-1)

    @staticmethod
    def settle(req: Request, plan: TierPlan) -> list[int]:
        """(Engine loop; never waits) fill `plan.statuses` (one per remote-promised block) from
        the request's finished reads and its own reads' byte and staged-block counts; blocks of
        reads still running are `timeout` (their deadline has passed).

        Returns:
            the transfer ids of the request's own reads it stopped waiting for (still running):
            what they bring is the tier's traffic, booked to no request.
        """
        status: dict[BlockHash, str | None] = {}
        abandoned: list[int] = []
        for r in plan.reads:
            own = r.request_num == req.request_num
            if not r.future.done():
                sts: list[str | None] = ["timeout"] * len(r.hashes)
                if own:
                    abandoned.append(r.transfer_id)
            else:
                try:
                    res = r.future.result()
                    sts = res.statuses
                    if own:
                        plan.remote_nbytes += res.nbytes
                        plan.staged_blocks += res.staged
                except Exception:  # a bug below us: recompute rather than fail the request
                    log.exception("prefetch failed unexpectedly")
                    sts = ["error"] * len(r.hashes)
            status.update(zip(r.hashes, sts, strict=True))
        hashes = req.block_hashes[plan.remote_lo:plan.remote_hi]
        plan.statuses = [status.get(h, "error") for h in hashes]
        plan.held = plan.reads
        plan.reads = []
        return abandoned

    def unpin(self, reads: list[Read]) -> None:
        """(Engine loop) a request has taken what it needs of `reads` (or no longer needs
        them): once no request needs a read, the blocks it pinned in staging are released
        (when it finishes, if it is still running)."""
        done: list[Read] = []
        with self._lock:
            for r in reads:
                r.users -= 1
                if r.users == 0:
                    done.append(r)
        for r in done:
            r.future.add_done_callback(self._release_pins)

    def _release_pins(self, fut: Future[ReadResult]) -> None:
        if fut.cancelled():
            return
        try:
            res = fut.result()
        except Exception:  # a failed prefetch pinned nothing it could release
            return
        for h in res.pinned:
            try:
                self.staging.release(h)
            except (KeyError, AssertionError):  # a bug, never a crash of the engine
                log.exception("unpinning a staged block failed")

    def close(self) -> None:
        """Refuse new reads and wait for the running ones. Idempotent."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)


def prefetch_into_host(remote: ResilientRemote, host: HostKVPool, block_hashes: Sequence[bytes],
                       namespace: bytes, *, transfer_id: int | None = None,
                       request_num: int = -1) -> ReadResult:
    """Load `block_hashes` from the remote tier into the host pool.

    Blocks already in the host pool are not read again and count as loaded. Every loaded
    block is pinned there (`ReadResult.pinned`) until the requests that need it have taken it.
    When the pool has no unreferenced slot left for a block (every slot pinned or in use),
    that block and the rest of the chain are not read: status `evicted`, a capacity failure
    like a promised block evicted before admission (the remedy is the same: a larger pool),
    not a remote one. A digest another prefetch holds reserved is `error` (not attempted).

    Returns:
        The read's result, one status per block in `block_hashes` (None: now in the host pool).
        The chain is usable up to its first failed block; blocks after it were loaded but
        cannot be used before the failed one is recomputed.
    """
    statuses: list[str | None] = [None] * len(block_hashes)
    todo: list[int] = []
    pinned: list[bytes] = []
    for i, h in enumerate(block_hashes):
        # A block already there is loaded too: pinned now, so it is still there at admission.
        if host.acquire(h) is not None:
            pinned.append(h)
        else:
            todo.append(i)
    want = [block_hashes[i] for i in todo]
    reserved: list[bytes] = []
    dests = []
    try:
        for h in want:
            host.reserve(h)
            reserved.append(h)
            dests.append(host.slot_bytes(h))
    except HostPoolFull:
        for i in todo[len(reserved):]:
            statuses[i] = "evicted"
    except KeyError:
        # Another prefetch holds the same digest reserved: not attempted.
        for i in todo[len(reserved):]:
            statuses[i] = "error"
    if not reserved:
        return ReadResult(statuses, transfer_id=-1 if transfer_id is None else transfer_id,
                          pinned=pinned)
    res = remote.read_into(reserved, namespace, dests, transfer_id=transfer_id,
                           request_num=request_num)
    for j, st in enumerate(res.statuses):
        statuses[todo[j]] = st
    loaded = [h for h, st in zip(reserved, res.statuses, strict=True) if st is None]
    failed = [h for h, st in zip(reserved, res.statuses, strict=True) if st is not None]
    for h in loaded:
        host.commit(h, pin=True)
        pinned.append(h)

    def free_failed() -> None:
        for h in failed:
            host.abort(h)

    res.when_buffers_free(free_failed)
    return ReadResult(statuses, res.nbytes, res.transfer_id, res.start_ns, res.end_ns,
                      res.pending, staged=len(loaded), pinned=pinned)
