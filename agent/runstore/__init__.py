"""The run store: a directory per run of Parquet dataset folders plus run.json (DESIGN.md §3).

    run-dir/
      run.json
      requests/part-00000.parquet ...
      spans/  layers/  samples/  events/

Parts are published by atomic rename, so a crash loses at most the part being written; readers
accept any subset of parts and report the gaps.
"""

from agent.runstore.reader import RunStore, open_run
from agent.runstore.writer import RunStoreWriter

__all__ = ["RunStore", "RunStoreWriter", "open_run"]
