"""The agent's run-store sink: buffers collector output, writes periodic parts, bounds disk.

Collector threads call `offer()` (cheap: an append under a lock); the agent's main thread calls
`flush()` every `--flush-interval`, which turns everything buffered into one `samples` part and
one `events` part (atomic renames by `RunStoreWriter`), then deletes the oldest sample/event
parts while the store exceeds its disk bound (readers report them as gaps).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from agent.runstore import RunStoreWriter
from agent.schema import EVENTS_SCHEMA, SAMPLES_SCHEMA
from collectors.base import Collection, Event, Sample

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
            events = [e for _, c in batch for e in c.events]
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


# NOTE: every column is built from buffers. `pa.array()` probes its input with pandas' type
# checks and imports pandas when it is installed (~0.5 s and tens of MiB); the agent must stay
# free of it, and these tables are small enough that building the buffers costs nothing.


def _int64(values: tuple[int, ...], offset: int = 0) -> pa.Array:
    buf = np.fromiter(values, dtype=np.int64, count=len(values))
    if offset:
        buf += offset
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(buf)])


def _float64(values: tuple[float, ...]) -> pa.Array:
    buf = np.fromiter(values, dtype=np.float64, count=len(values))
    return pa.Array.from_buffers(pa.float64(), len(values), [None, pa.py_buffer(buf)])


def _string(values: tuple[str | None, ...] | list[str | None]) -> pa.Array:
    n = len(values)
    enc = [b"" if v is None else v.encode() for v in values]
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, enc), dtype=np.int32, count=n), out=offsets[1:])
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=n)
    nulls = n - int(valid.sum())
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    return pa.Array.from_buffers(pa.string(), n, [bitmap, pa.py_buffer(offsets),
                                                  pa.py_buffer(b"".join(enc))], null_count=nulls)


def samples_table(samples: list[Sample], offset_ns: int) -> pa.Table:
    """Samples (monotonic ts) → a `samples` table in epoch ns."""
    ts, source, entity, metric, value, unit = zip(*samples, strict=True)
    return pa.Table.from_arrays(
        [_int64(ts, offset_ns), _string(source), _string(entity), _string(metric),
         _float64(value), _string(unit)],
        schema=SAMPLES_SCHEMA,
    )


def events_table(events: list[Event], offset_ns: int) -> pa.Table:
    """Events (monotonic ts) → an `events` table in epoch ns (detail as JSON text)."""
    ts, source, name, detail = zip(*events, strict=True)
    return pa.Table.from_arrays(
        [_int64(ts, offset_ns), _string(source), _string(name), _string([None] * len(events)),
         _string([None if d is None else json.dumps(d, sort_keys=True) for d in detail])],
        schema=EVENTS_SCHEMA,
    )
