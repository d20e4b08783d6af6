"""The agent's run-store sink: buffers collector output, writes periodic parts, bounds disk.

Collector threads call `offer()` (cheap: an append under a lock); the agent's main thread calls
`flush()` every `--flush-interval`, which turns everything buffered into one `samples` part and
one `events` part (atomic renames by `RunStoreWriter`), then deletes the oldest sample/event
parts while the store exceeds its disk bound (readers report them as gaps).

The bound is kept without listing the store at every flush (`RunStoreWriter.prune` stats every
part, so an agent's flush would cost more the longer it runs): the sink lists the parts once
when it opens the store, then adds each part it writes (one `stat`) and drops each it deletes;
the parts go oldest first in `RunStoreWriter.prune`'s order (modification time, sequence
number, name). Nothing else writes the store while the agent runs (a second agent is
refused); a part someone else deleted meanwhile makes the sink list the store again.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.runstore.layout import PART_RE
from agent.runstore.writer import RunStoreWriter
from agent.schema import TABLES
from agent.telemetry.tables import events_table, samples_table
from collectors.base import Collection

log = logging.getLogger(__name__)

#: The tables whose parts the disk bound may delete (`RunStoreWriter.prune`'s default).
PRUNABLE = ("samples", "events")
_RANK = {t: i for i, t in enumerate(TABLES)}


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
        # With a disk bound: bytes of every published part, and the prunable parts as
        # (mtime_ns, seq, name, table's rank in TABLES, path, size), sorted: prune's order
        # (its ties, the same name in two tables at the same mtime, go in TABLES order).
        self._disk_bytes = 0
        self._prunable: list[tuple[int, int, str, int, Path, int]] = []
        self._listed = False
        if max_disk_bytes is not None:
            try:
                self._list_parts()
            except OSError:
                pass  # the first flush lists it (and says so if it still cannot)

    def _list_parts(self) -> None:
        """Take the store's parts from the disk (as `RunStoreWriter.disk_bytes` and `prune`
        see them)."""
        parts = self.writer._parts(tuple(TABLES))
        self._listed = True
        self._disk_bytes = sum(size for _, _, size, _ in parts)
        self._prunable = sorted((mtime, seq, p.name, _RANK[p.parent.name], p, size)
                                for mtime, seq, size, p in parts if p.parent.name in PRUNABLE)

    def _wrote(self, table: str, path: Path | None) -> None:
        """Account for the part `path` just published in `table`."""
        if path is None or not self._listed:
            return  # no bound (yet): a bound set later lists the store first
        try:
            st = os.stat(path)
        except OSError:  # deleted already: let the disk say
            self._list_parts()
            return
        self._disk_bytes += st.st_size
        m = PART_RE.match(path.name)
        if table in PRUNABLE and m is not None:
            bisect.insort(self._prunable, (st.st_mtime_ns, int(m.group(1)), path.name,
                                           _RANK[table], path, st.st_size))

    def _prune(self, max_bytes: int) -> int:
        """Delete the oldest prunable parts while the store exceeds `max_bytes` (what
        `RunStoreWriter.prune` does, from the sink's account); returns the parts deleted."""
        deleted = 0
        while True:
            parts = self._prunable
            done = 0
            gone = False  # a part someone else deleted: the account is off, list again
            try:
                while self._disk_bytes > max_bytes and done < len(parts):
                    path, size = parts[done][4:]
                    try:
                        path.unlink()
                        deleted += 1
                    except FileNotFoundError:
                        gone = True
                    self._disk_bytes -= size
                    done += 1
            finally:
                del parts[:done]
                if gone:
                    self._list_parts()
            if not gone:
                return deleted

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
                    self._wrote("samples",
                                self.writer.write("samples", samples_table(samples, off)))
                    res.samples = len(samples)
                if events:
                    self._wrote("events", self.writer.write("events", events_table(events, off)))
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
                    if not self._listed:
                        self._list_parts()
                    res.pruned_parts = self._prune(self.max_disk_bytes)
                except OSError as exc:
                    log.error("kvscope agent: pruning the run store failed: %s", exc)
                if res.pruned_parts:
                    self.pruned_parts += res.pruned_parts
                    self.writer.update_meta(pruned_parts=self.pruned_parts)
            return res

    @property
    def pending_samples(self) -> int:
        return self._pending_samples
