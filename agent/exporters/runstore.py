"""The run-store sink: every drained batch becomes Parquet parts of the run directory."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from agent.runstore import RunStoreWriter


class RunStoreSink:
    """Writes each drained batch as new parts (`RunStoreWriter.write_all`).

    On shutdown it records in run.json what telemetry was lost before it reached the store
    (`telemetry`: the recorder's and the pipeline's drop counts, failed writes), so analyzers can
    tell a complete run from one with holes, then closes the writer with `status`.

    Args:
        writer: an open `RunStoreWriter`.
        status: run.json status written on shutdown (set `sink.status` before closing the
            pipeline to record e.g. "error" or "aborted").
    """

    name = "runstore"

    def __init__(self, writer: RunStoreWriter, *, status: str = "complete") -> None:
        self.writer = writer
        self.status = status
        self.failed_batches = 0
        self._pipeline: Any = None

    def bind_pipeline(self, pipeline: Any) -> None:
        """Remember the pipeline so shutdown can record its drop counts in run.json."""
        self._pipeline = pipeline

    def export(self, batch: dict[str, pa.Table]) -> None:
        try:
            self.writer.write_all(batch)
        except Exception:
            self.failed_batches += 1
            raise

    def flush(self) -> None:
        """Nothing buffered: every export already published its parts."""

    def shutdown(self) -> None:
        if self.writer.closed:
            return
        lost: dict[str, Any] = {"failed_batches": self.failed_batches}
        pipe = self._pipeline
        if pipe is not None:
            lost["pipeline_dropped_rows"] = dict(pipe.stats.dropped_rows)
            rec_stats = getattr(pipe.recorder, "stats", None)
            if rec_stats is not None:
                lost["recorder_dropped_rows"] = dict(rec_stats.dropped)
                lost["recording_errors"] = rec_stats.recording_errors
        self.writer.update_meta(telemetry=lost)
        self.writer.close(status=self.status)
