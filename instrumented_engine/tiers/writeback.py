"""Write-behind: new full blocks are stored to the host and remote tiers off the critical path.

The engine hands over a block it has just computed (already gathered off the device into a
payload tensor it will not touch again) and returns at once. One worker thread drains a bounded
queue: host `put`, then remote `write`. When the queue is full the block is skipped and counted
(`skipped`): losing a cache write costs a future recompute, blocking the engine costs latency
now. Failures are counted by reason and never raised into the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from instrumented_engine.tiers.host import HostKVPool
from instrumented_engine.tiers.remote import ResilientRemote
from instrumented_engine.tiers.stats import OpStats

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class _Job:
    digest: bytes
    namespace: bytes
    payload: torch.Tensor


_STOP = object()


class WriteBehind:
    """A bounded queue and one worker storing blocks to `host` and/or `remote`.

    Args:
        host: the host pool (None: skip the host tier).
        remote: the remote tier (None: skip it).
        capacity: queued blocks at most (>= 1).
    """

    def __init__(self, host: HostKVPool | None, remote: ResilientRemote | None, *,
                 capacity: int = 256) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"WriteBehind capacity must be an int >= 1, got {capacity!r}")
        self.host = host
        self.remote = remote
        self.capacity = capacity
        self.stats = OpStats()
        self._q: queue.Queue[_Job | object] = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._work, name="kvscope-writeback", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, digest: bytes, namespace: bytes, payload: torch.Tensor) -> bool:
        """Queue one block; never blocks.

        Args:
            digest: the block's chain digest.
            namespace: the request's namespace digest (stored in the remote header).
            payload: a CPU tensor shaped `layout.payload_shape` that the caller will not modify.

        Returns:
            True when queued, False when skipped (queue full or closed; counted as `skipped`).
        """
        if self._closed:
            self.stats.add("skipped_closed")
            return False
        try:
            self._q.put_nowait(_Job(digest, namespace, payload))
        except queue.Full:
            self.stats.add("skipped")
            return False
        self.stats.add("queued")
        return True

    def pending(self) -> int:
        """Blocks queued and not yet stored."""
        return self._q.unfinished_tasks

    def _work(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is _STOP:
                    return
                assert isinstance(job, _Job)
                self._store(job)
            finally:
                self._q.task_done()

    def _store(self, job: _Job) -> None:
        if self.host is not None:
            try:
                self.host.put(job.digest, job.payload)
                self.stats.add("host_stored")
            except Exception as e:  # HostPoolFull or a bad payload: count, never raise
                self.stats.fail(f"host_{type(e).__name__}")
                log.debug("write-behind host put failed: %s", e)
        if self.remote is not None:
            try:
                reason = self.remote.write(job.digest, job.namespace, job.payload)
            except Exception as e:
                reason = "error"
                log.warning("write-behind remote write failed: %s", e)
            if reason is None:
                self.stats.add("remote_stored")
            else:
                self.stats.fail(f"remote_{reason}")

    def flush(self) -> None:
        """Wait until every queued block has been stored (or failed)."""
        self._q.join()

    def close(self) -> None:
        """Flush, then stop the worker."""
        if self._closed:
            return
        self._closed = True
        self._q.put(_STOP)
        self._thread.join()
