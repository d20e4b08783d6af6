"""The run store: a directory per run of Parquet dataset folders plus run.json (docs/DESIGN.md,
"The run store").

    run-dir/
      run.json
      requests/part-00000.parquet ...
      spans/  layers/  samples/  events/

Parts are published by atomic rename, so a crash loses at most the part being written; readers
accept any subset of parts and report the gaps.

`agent.runstore.reader` (`open_run`, `RunStore`) is what analyses import; the writer
(`agent.runstore.writer.RunStoreWriter`) belongs to the telemetry plane. Both names are also
available here, loaded on first use, so importing the package loads neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.runstore.reader import RunStore, open_run
    from agent.runstore.writer import RunStoreWriter

__all__ = ["RunStore", "RunStoreWriter", "open_run"]


def __getattr__(name: str) -> Any:
    if name in ("RunStore", "open_run"):
        from agent.runstore import reader

        return getattr(reader, name)
    if name == "RunStoreWriter":
        from agent.runstore.writer import RunStoreWriter

        return RunStoreWriter
    raise AttributeError(f"module 'agent.runstore' has no attribute {name!r}")
