"""Tiny builders of run-store-shaped frames for analyzer tests (only the columns they use)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd


def requests_frame(rows: Iterable[tuple[str, int, int | None]], **extra: list[Any]
                   ) -> pd.DataFrame:
    """Rows of (request_id, arrival_ns, first_token_ns); `extra` adds columns."""
    rows = list(rows)
    df = pd.DataFrame({
        "request_id": [r[0] for r in rows],
        "arrival_ns": pd.array([r[1] for r in rows], dtype="Int64"),
        "first_token_ns": pd.array([r[2] for r in rows], dtype="Int64"),
    })
    for k, v in extra.items():
        df[k] = v
    return df


def spans_frame(rows: Iterable[tuple[str | None, str, str, int, int]]) -> pd.DataFrame:
    """Rows of (request_id, kind, name, start_ns, end_ns)."""
    rows = list(rows)
    return pd.DataFrame({
        "request_id": pd.array([r[0] for r in rows], dtype="str"),
        "kind": pd.array([r[1] for r in rows], dtype="str"),
        "name": pd.array([r[2] for r in rows], dtype="str"),
        "start_ns": pd.array([r[3] for r in rows], dtype="int64"),
        "end_ns": pd.array([r[4] for r in rows], dtype="int64"),
    })
