"""The runs' tables read while the dashboard's server is still starting.

`dashboard.serve` calls `start` first thing, then imports pandas, Plotly, the analyzers and
Streamlit's server on its main thread; meanwhile a thread reads each run directory's Parquet
parts into Arrow tables (Arrow releases the GIL while it reads, so on a machine with two
cores the read and the imports overlap instead of following one another). `dashboard.data`'s
`load_run` then takes the tables read (`take`) instead of reading them again, and converts them
to DataFrames itself.

This module imports only the run-store reader (pyarrow): the reading thread must never import
pandas, which the main thread is importing at the same time.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agent.runstore.reader import DEFAULT_REQUIRED, RunStore, open_run
from agent.schema import TABLES

#: How long `take` waits for a read still in progress before reading the run itself.
TAKE_WAIT_S = 120.0

_lock = threading.Lock()
_read: dict[str, tuple[int, RunStore]] = {}
_pending: dict[str, threading.Event] = {}


def run_version(path: str | os.PathLike[str]) -> int:
    """The newest mtime (ns) of a run directory's run.json and table folders, or of a file.

    Adding a part renames a file into a table folder, which bumps that folder's mtime, so this
    stats a handful of entries, not every part. Raises FileNotFoundError when `path` is absent.
    """
    p = Path(path)
    newest = p.stat().st_mtime_ns
    if p.is_dir():
        for name in ("run.json", *TABLES):
            try:
                newest = max(newest, (p / name).stat().st_mtime_ns)
            except FileNotFoundError:
                continue
    return newest


def read_store(p: Path) -> RunStore:
    """`agent.runstore.open_run` of a run directory, its tables read concurrently (one thread
    per table; Arrow releases the GIL while it reads): the same store `open_run(p)` returns,
    each table through `open_run(p, tables=(name,))` (the one validation of run.json and of the
    parts), gaps in table order, and a run whose spans are missing while it has requests
    refused as `open_run` refuses it. Tables stay Arrow (`RunStore.frame` converts)."""
    names = tuple(TABLES)

    def one(name: str) -> RunStore:
        return open_run(p, tables=(name,), require=())

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        parts = dict(zip(names, pool.map(one, names), strict=True))
    store = RunStore(path=p, meta=parts[names[0]].meta,
                     tables={n: parts[n].tables[n] for n in names},
                     gaps=[g for n in names for g in parts[n].gaps],
                     parts={n: parts[n].parts.get(n, []) for n in names},
                     missing=[m for n in names for m in parts[n].missing])
    has_requests = bool(store.tables["requests"].num_rows)
    for name in DEFAULT_REQUIRED:
        if name in store.missing and has_requests:
            open_run(p)  # raises InputError naming the missing table, as `open_run` does
    return store


def start(paths: Sequence[str]) -> threading.Thread:
    """Read every run directory among `paths` on a background thread (files, which importers
    read, and runs that cannot be read are left to `load_run`, which says why)."""
    todo = [str(x) for x in paths if Path(x).is_dir()]
    with _lock:
        for path in todo:
            _pending.setdefault(path, threading.Event())

    def work() -> None:
        for path in todo:
            try:
                version = run_version(path)
                store = read_store(Path(path))
            except Exception:  # load_run reads it again and says why
                pass
            else:
                with _lock:
                    _read[path] = (version, store)
            finally:
                _pending[path].set()

    thread = threading.Thread(target=work, name="kvscope-preread", daemon=True)
    thread.start()
    return thread


def take(path: str, version: int) -> RunStore | None:
    """The store read ahead for `path` at `version` (waiting for a read in progress), once;
    None when none was read, it failed, or the run has changed since."""
    with _lock:
        event = _pending.get(path)
    if event is not None:
        event.wait(TAKE_WAIT_S)
    with _lock:
        _pending.pop(path, None)
        got = _read.pop(path, None)
    if got is None or got[0] != version:
        return None
    return got[1]
