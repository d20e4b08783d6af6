"""The agent's run-store sink: buffers collector output, writes periodic parts, bounds disk.

Collector threads call `offer()` (cheap: an append under a lock); the agent's main thread calls
`flush()` every `--flush-interval`, which turns everything buffered into one `samples` part and
one `events` part (atomic renames by `RunStoreWriter`), then deletes the oldest sample/event
parts while the store exceeds its disk bound (readers report them as gaps).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from agent.runstore.writer import RunStoreWriter
from agent.telemetry.tables import events_table, samples_table
from collectors.base import Collection

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FlushResult:
    samples: int = 0
    events: int = 0
    pruned_parts: int = 0
    failed: bool = False


class StoreSink:
    """Buffers collections and writes them as run-store parts.

    Args:
        writer: the run store.
        max_pending_samples: samples held between flushes; beyond it a collection's samples
            are dropped and counted.
        max_disk_bytes: disk bound for the store (None = unbounded).
        on_dropped: told (collector name, samples) about samples lost to a failed write.
    """

    def __init__(self, writer: RunStoreWriter, *, max_pending_samples: int = 1_000_000,
                 max_disk_bytes: int | None = None,
                 on_dropped: Callable[[str, int], None] | None = None) -> None:
        self.writer = writer
        self.max_pending_samples = max_pending_samples
        self.max_disk_bytes = max_disk_bytes
        self.on_dropped = on_dropped
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._pending: deque[tuple[str, Collection]] = deque()
        self._pending_samples = 0
        self.pruned_parts = 0
        self.write_errors = 0

    def offer(self, name: str, col: Collection) -> int:
        """Queue one collector run (the runner's `on_samples`); returns samples dropped."""
        n = len(col.samples)
        with self._lock:
            if n and self._pending_samples + n > self.max_pending_samples:
                if col.events:
                    self._pending.append((name, Collection(col.ts_ns, events=col.events)))
                return n
            self._pending.append((name, col))
            self._pending_samples += n
        return 0

    def flush(self) -> FlushResult:
        """Write what is buffered as one part per table, then enforce the disk bound."""
        with self._flush_lock:
            with self._lock:
                batch = list(self._pending)
                self._pending.clear()
                self._pending_samples = 0
            res = FlushResult()
            samples = [s for _, c in batch for s in c.samples]
            # Collector events name no request: the table's request_id is null.
            events = [(e.ts_ns, e.source, e.name, None, e.detail) for _, c in batch
                      for e in c.events]
            off = self.writer.anchor.offset_ns
            try:
                if samples:
                    self.writer.write("samples", samples_table(samples, off))
                    res.samples = len(samples)
                if events:
                    self.writer.write("events", events_table(events, off))
                    res.events = len(events)
            except OSError as exc:
                self.write_errors += 1
                res.failed = True
                log.error("kvscope agent: writing the run store failed: %s; %d samples lost",
                          exc, len(samples) - res.samples)
                if self.on_dropped is not None and not res.samples:
                    for name, c in batch:
                        if c.samples:
                            self.on_dropped(name, len(c.samples))
            if self.max_disk_bytes is not None:
                try:
                    res.pruned_parts = self.writer.prune(self.max_disk_bytes)
                except OSError as exc:
                    log.error("kvscope agent: pruning the run store failed: %s", exc)
                if res.pruned_parts:
                    self.pruned_parts += res.pruned_parts
                    self.writer.update_meta(pruned_parts=self.pruned_parts)
            return res

    @property
    def pending_samples(self) -> int:
        return self._pending_samples
