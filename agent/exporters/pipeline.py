"""The telemetry pipeline: drains the recorder off the engine's thread and feeds the sinks.

    drain thread ──every interval_s: recorder.drain()──► bounded queue ──► worker ──► each sink

The engine never waits on an exporter: when the queue is full the new batch is dropped and its
rows are counted per table; an exception in a sink is caught, counted per sink, logged (rate
limited) and the next sink still gets the batch. `close()` drains one last time, flushes and
shuts every sink down, and never raises.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa

log = logging.getLogger(__name__)


class Sink(Protocol):
    """What the pipeline hands batches to. `export` may raise; the pipeline counts it.

    A sink may also define `bind_pipeline(pipeline)`, called once at construction (the
    Prometheus exporter uses it to expose the pipeline's stats).
    """

    name: str

    def export(self, batch: dict[str, pa.Table]) -> None: ...

    def flush(self) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class PipelineStats:
    """What the pipeline moved and lost. Written by the pipeline's threads; read anywhere.

    Attributes:
        batches: drained batches queued for export.
        exported_batches: batches handed to every sink.
        rows: rows queued, per table.
        dropped_batches: batches dropped because the queue was full.
        dropped_rows: rows of those batches, per table.
        export_errors: failed export/flush/shutdown calls, per sink name.
        drain_errors: `recorder.drain()` calls that raised.
    """

    batches: int = 0
    exported_batches: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    dropped_batches: int = 0
    dropped_rows: dict[str, int] = field(default_factory=dict)
    export_errors: dict[str, int] = field(default_factory=dict)
    drain_errors: int = 0


class RateLimitedLog:
    """Logs at most once per `period_s` per key, saying how many were suppressed meanwhile."""

    def __init__(self, logger: logging.Logger, period_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._period = period_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def error(self, key: str, msg: str, *args: Any, exc_info: bool = True) -> bool:
        """Log `msg` unless `key` was logged within the period; returns whether it logged."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._period:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        skipped = self._suppressed.pop(key, 0)
        if skipped:
            msg += " (%d similar message(s) suppressed)"
            args = (*args, skipped)
        self._log.error(msg, *args, exc_info=exc_info)
        return True


_STOP = object()


def _rows(batch: dict[str, pa.Table]) -> dict[str, int]:
    return {name: tbl.num_rows for name, tbl in batch.items()}


def _add(counts: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        counts[k] = counts.get(k, 0) + v


class TelemetryPipeline:
    """Drains `recorder` every `interval_s` into a bounded queue that a worker exports.

    Args:
        recorder: the `agent.telemetry.Recorder` (anything with `drain()`).
        sinks: each with `name`, `export(batch)`, `flush()`, `shutdown()`; names must differ.
        interval_s: seconds between drains (0.01..3600).
        queue_size: batches that may wait for the worker (1..100000).
        close_timeout_s: how long `close()` waits for a stuck sink before giving up on it.
        log_period_s: at most one error log per sink per period.
    """

    def __init__(
        self,
        recorder: Any,
        sinks: Sequence[Sink],
        *,
        interval_s: float = 1.0,
        queue_size: int = 64,
        close_timeout_s: float = 10.0,
        log_period_s: float = 60.0,
    ) -> None:
        if not 0.01 <= interval_s <= 3600:
            raise ValueError(f"interval_s: must be in 0.01..3600 seconds, got {interval_s}")
        if not 1 <= queue_size <= 100_000:
            raise ValueError(f"queue_size: must be in 1..100000 batches, got {queue_size}")
        if close_timeout_s <= 0:
            raise ValueError(f"close_timeout_s: must be > 0 seconds, got {close_timeout_s}")
        names = [s.name for s in sinks]
        if len(set(names)) != len(names):
            raise ValueError(f"sinks: names must be unique, got {names}")
        self.recorder = recorder
        self.sinks = list(sinks)
        self.interval_s = interval_s
        self.close_timeout_s = close_timeout_s
        self.stats = PipelineStats(export_errors={n: 0 for n in names})
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()  # recorder.drain() is not reentrant
        self._errlog = RateLimitedLog(log, log_period_s)
        self._drainer: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        self._busy: Sink | None = None  # the sink the worker is in (to spot a stuck one)
        self._abandoned = False  # set by close() when it gives up on a stuck worker
        self._closed = False
        self._close_lock = threading.Lock()
        for sink in self.sinks:
            bind = getattr(sink, "bind_pipeline", None)
            if bind is not None:
                bind(self)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> TelemetryPipeline:
        """Start the drain and export threads (daemons). Returns self."""
        if self._closed:
            raise RuntimeError("TelemetryPipeline: start() after close()")
        if self._drainer is None:
            self._worker = threading.Thread(target=self._work, name="kvscope-export",
                                            daemon=True)
            self._drainer = threading.Thread(target=self._drain_loop, name="kvscope-drain",
                                             daemon=True)
            self._worker.start()
            self._drainer.start()
        return self

    def __enter__(self) -> TelemetryPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._drainer is not None and not self._closed

    def drain_now(self) -> bool:
        """Drain the recorder once and queue the batch (also what the drain thread does).

        Returns False when the batch had to be dropped (queue full) or the drain failed.
        """
        return self._drain_once(block=False)

    def close(self) -> None:
        """Stop draining, export everything recorded so far, flush and shut down every sink.

        Idempotent; never raises. A sink stuck for longer than `close_timeout_s` is abandoned
        (its later batches count as dropped).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._stop.set()
            if self._drainer is not None:
                self._drainer.join(timeout=self.close_timeout_s)
            if self._worker is not None:
                self._drain_once(block=True)
                try:
                    self._queue.put(_STOP, timeout=self.close_timeout_s)
                except queue.Full:
                    pass
                self._worker.join(timeout=self.close_timeout_s)
            else:  # never started: export what drain_now() queued and the final drain here
                self._work()
                self._drain_once(block=False)  # the queue is empty now: this cannot drop
                self._work()
            sinks = self.sinks
            if self._worker is not None and self._worker.is_alive():
                # The worker stays inside a stuck sink: it must not touch the other sinks once
                # they are shut down, and the stuck one's flush/shutdown would block us too.
                self._abandoned = True
                self._drop_queued()
                stuck = self._busy
                if stuck is not None:
                    log.error("kvscope telemetry: exporter %r is stuck; closing without it",
                              stuck.name)
                    self.stats.export_errors[stuck.name] = (
                        self.stats.export_errors.get(stuck.name, 0) + 1)
                    sinks = [s for s in sinks if s is not stuck]
            for sink in sinks:
                self._call(sink, "flush")
            for sink in sinks:
                self._call(sink, "shutdown")
        except Exception:  # pragma: no cover - belt and braces: close() must never raise
            log.exception("kvscope telemetry: pipeline close failed")

    # ------------------------------------------------------------------ threads
    def _drain_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._drain_once(block=False)

    def _drain(self) -> dict[str, pa.Table] | None:
        with self._drain_lock:
            try:
                return self.recorder.drain()
            except Exception:
                self.stats.drain_errors += 1
                self._errlog.error("drain", "kvscope telemetry: recorder.drain() failed")
                return None

    def _drain_once(self, *, block: bool) -> bool:
        batch = self._drain()
        if batch is None:
            return False
        if not batch:
            return True
        rows = _rows(batch)
        try:
            if block:
                self._queue.put(batch, timeout=self.close_timeout_s)
            else:
                self._queue.put_nowait(batch)
        except queue.Full:
            self.stats.dropped_batches += 1
            _add(self.stats.dropped_rows, rows)
            return False
        self.stats.batches += 1
        _add(self.stats.rows, rows)
        return True

    def _work(self) -> None:
        while True:
            if self._worker is None:  # close() of a pipeline never started: no waiting
                try:
                    batch = self._queue.get_nowait()
                except queue.Empty:
                    return
            else:
                batch = self._queue.get()
            if batch is _STOP or self._abandoned:
                return
            self._export(batch)

    def _export(self, batch: dict[str, pa.Table]) -> None:
        for sink in self.sinks:
            if self._abandoned:
                return
            self._busy = sink
            self._call(sink, "export", batch)
        self._busy = None
        self.stats.exported_batches += 1

    def _call(self, sink: Sink, method: str, *args: Any) -> None:
        try:
            getattr(sink, method)(*args)
        except Exception:
            errors = self.stats.export_errors
            errors[sink.name] = errors.get(sink.name, 0) + 1
            self._errlog.error(sink.name, "kvscope telemetry: exporter %r failed in %s()",
                               sink.name, method)

    def _drop_queued(self) -> None:
        """Count the queued batches as dropped; leave only the stop marker for the worker."""
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                break
            if batch is not _STOP:
                self.stats.dropped_batches += 1
                _add(self.stats.dropped_rows, _rows(batch))
        self._queue.put_nowait(_STOP)  # the queue is empty: lets the worker exit when it can
