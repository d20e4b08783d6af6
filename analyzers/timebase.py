"""The one time base of every kvscope surface: seconds since the run's start.

The run store's times are epoch ns on the engine's clock (docs/DESIGN.md, "Time base"); the
run's start is run.json's ``start_ns``. The analyze report's windows, the diagnoses' windows and
their `kvscope timeline --window START:END` commands, the timeline's own ``--window``, and the
dashboard's time axes all count from it, and print it with its unit (``0 s``, ``6.000 s``).
A store without a recorded start (an import) counts from its earliest recorded time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agent.errors import InputError

__all__ = ["run_origin_ns", "seconds_since"]

#: (table, time column) pairs that bound a run when run.json has no start.
_TIME_COLUMNS = (("requests", "arrival_ns"), ("spans", "start_ns"), ("samples", "ts_ns"),
                 ("events", "ts_ns"))


def run_origin_ns(meta: dict[str, Any], store: Any = None) -> int:
    """The run's time origin (epoch ns): run.json's ``start_ns``; without one, the earliest
    time recorded in `store`'s tables (Arrow ``tables`` or pandas frames).

    Raises:
        InputError: neither is available.
    """
    start = meta.get("start_ns")
    if isinstance(start, int) and not isinstance(start, bool):
        return start
    found: list[int] = []
    if store is not None:
        tables = getattr(store, "tables", None)
        for table, col in _TIME_COLUMNS:
            t = tables.get(table) if isinstance(tables, dict) else getattr(store, table, None)
            if t is None or col not in getattr(t, "column_names", getattr(t, "columns", ())):
                continue
            v = np.asarray(t[col].to_numpy(), dtype="float64") if len(t) else np.zeros(0)
            v = v[np.isfinite(v)]
            if len(v):
                found.append(int(v.min()))
    if not found:
        where = getattr(store, "path", "the run")
        raise InputError(f"{where}: run.json has no start_ns and the run holds no times")
    return min(found)


def seconds_since(ns: Any, origin_ns: int) -> Any:
    """Epoch ns (scalar or array) → seconds since `origin_ns` (float)."""
    return (np.asarray(ns, dtype=np.int64) - np.int64(origin_ns)) / 1e9
