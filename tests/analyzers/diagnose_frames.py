"""Small hand-built run-store frames for the diagnosis tests, with exact numbers.

Frames go through the run store's own Arrow schemas and `to_pandas`, so dtypes match what
`agent.runstore.open_run` gives (nullable ints as ``Int64``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import pyarrow as pa

from agent.runstore.reader import to_pandas
from agent.schema import (
    ACCOUNTING_COLUMNS,
    EVENTS_SCHEMA,
    REQUESTS_SCHEMA,
    SAMPLES_SCHEMA,
    SPANS_SCHEMA,
    TTFT_STAGES,
)

MS = 1_000_000
S = 1_000_000_000
#: Epoch origin of every hand-built run.
T0 = 1_700_000_000 * S


def frame(schema: pa.Schema, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Rows (missing keys null) → DataFrame with the run store's dtypes."""
    cols = {f.name: [r.get(f.name) for r in rows] for f in schema}
    return to_pandas(pa.table(cols, schema=schema), schema)


def build(
    stages: Sequence[Mapping[str, int]],
    acct: Sequence[Mapping[str, int]] | Mapping[str, int] | None = None,
    *,
    gap_ns: int = 100 * MS,
    extra_spans: Sequence[Mapping[str, Any]] = (),
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A run whose request i arrives at ``T0 + i * gap_ns`` and whose state spans lay its
    `stages` (stage → ns) end to end in TTFT_STAGES order.

    Args:
        stages: per request, ns per stage (missing stages 0).
        acct: accounting per request, or one mapping for all (missing columns 0).
        gap_ns: time between arrivals.
        extra_spans: more span rows (e.g. activity spans), SPANS_SCHEMA keys.
    Returns:
        (requests, spans).
    """
    n = len(stages)
    accts = [acct or {}] * n if acct is None or isinstance(acct, Mapping) else list(acct)
    assert len(accts) == n
    req_rows, span_rows = [], []
    for i, (st, ac) in enumerate(zip(stages, accts, strict=True)):
        rid, t = f"r{i:03d}", T0 + i * gap_ns
        arrival = t
        for s in TTFT_STAGES:
            d = st.get(s, 0)
            if d:
                span_rows.append({"request_id": rid, "request_num": i, "kind": "state",
                                  "name": s, "start_ns": t, "end_ns": t + d, "clock": "cpu"})
                t += d
        row = {c: int(ac.get(c, 0)) for c in ACCOUNTING_COLUMNS}
        row.update(request_id=rid, request_num=i, tenant="t0", workload_class="chat",
                   arrival_ns=arrival, first_token_ns=t, finish_ns=t + MS, status="ok")
        req_rows.append(row)
    spans = [*span_rows, *({"clock": "cpu", **s} for s in extra_spans)]
    return frame(REQUESTS_SCHEMA, req_rows), frame(SPANS_SCHEMA, spans)


def samples(rows: Sequence[tuple[int, str, str | None, str, float]]) -> pd.DataFrame:
    """Samples from ``(ts_ns, source, entity, metric, value)`` tuples."""
    return frame(SAMPLES_SCHEMA, [dict(zip(("ts_ns", "source", "entity", "metric", "value"),
                                           r, strict=True)) for r in rows])


def events(rows: Sequence[tuple[int, str]]) -> pd.DataFrame:
    """Events from ``(ts_ns, name)`` tuples (source ``engine``)."""
    return frame(EVENTS_SCHEMA, [{"ts_ns": t, "source": "engine", "name": n} for t, n in rows])
