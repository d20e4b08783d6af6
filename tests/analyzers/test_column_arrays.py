"""The analyzers read each column through its array (`ttft_summary.column_array`, no Series
built): the fast readers give exactly what `analyzers.frames.ints` / `valid` give over every
column dtype, and the partition, its summary and the accounting are the same frames whatever
the dtypes of their input (Arrow-backed or object or categorical strings, nullable or plain
integers), with no output column sharing memory with the input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from agent.schema import ACCOUNTING_COLUMNS
from analyzers import frames as F
from analyzers import ttft_summary as S
from analyzers.accounting import token_accounting
from analyzers.ttft import partition, summarize


def _columns() -> pd.DataFrame:
    n = 9
    return pd.DataFrame({
        "i64": np.arange(n, dtype=np.int64) - 3,
        "i32": np.arange(n, dtype=np.int32),
        "u8": np.arange(n, dtype=np.uint8),
        "b": np.arange(n) % 2 == 0,
        "f": np.where(np.arange(n) % 3 == 0, np.nan, np.arange(n, dtype=np.float64)),
        "I64": pd.array([None if i % 4 == 0 else i * 10 for i in range(n)], dtype="Int64"),
        "I64full": pd.array(list(range(n)), dtype="Int64"),
        "I32": pd.array([None if i == 2 else i for i in range(n)], dtype="Int32"),
        "bool": pd.array([None if i == 1 else i % 2 == 0 for i in range(n)], dtype="boolean"),
        "ts": pd.array([None if i == 5 else "x" for i in range(n)], dtype="str"),
        "obj": np.array([None if i == 5 else "x" for i in range(n)], dtype=object),
        "pa": pd.array([None if i == 6 else i for i in range(n)], dtype="int64[pyarrow]"),
    })


@pytest.mark.parametrize("col", ["i64", "i32", "u8", "b", "f", "I64", "I64full", "I32", "bool",
                                 "pa"])
@pytest.mark.parametrize("fill", [-1, 0])
def test_int_column_equals_frames_ints(col: str, fill: int) -> None:
    df = _columns()
    got = S.int_column(df, col, fill)
    want = F.ints(df[col], fill)
    assert got.dtype == want.dtype == np.int64
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("col", list(_columns().columns))
def test_valid_column_and_column_array_equal_the_series(col: str) -> None:
    df = _columns()
    assert S.valid_column(df, col).tolist() == F.valid(df[col]).tolist()
    a = S.column_array(df, col)
    want = df[col].to_numpy() if isinstance(df[col].dtype, np.dtype) else df[col].array
    assert type(a) is type(want)
    assert pd.Series(a).equals(pd.Series(want))


def test_column_array_of_a_duplicated_name_falls_back_to_the_frame() -> None:
    df = pd.DataFrame([[1, 2], [3, 4]], columns=["a", "a"])
    with pytest.raises((TypeError, ValueError, AttributeError)):
        S.int_column(df, "a")  # two columns: what `F.ints(df["a"])` does (it raises too)
    with pytest.raises((TypeError, ValueError, AttributeError)):
        F.ints(df["a"])


def _frames(n: int = 40, seed: int = 3) -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    arrival = np.arange(n, dtype=np.int64) * 1_000 + 10**12
    first = arrival + rng.integers(10, 900, n)
    req: dict[str, object] = {
        "request_id": pd.array([f"r{i}" for i in range(n)], dtype="str"),
        "request_num": np.arange(n, dtype=np.int64),
        "tenant": pd.array([f"t{i % 3}" for i in range(n)], dtype="str"),
        "arrival_ns": arrival,
        "first_token_ns": pd.array(first.tolist(), dtype="Int64"),
        "finish_ns": pd.array((first + 50).tolist(), dtype="Int64"),
        "output_tokens": rng.integers(1, 9, n),
    }
    for c in ACCOUNTING_COLUMNS:
        req[c] = rng.integers(0, 50, n)
    rows = []
    for i in range(n):
        a, f = int(arrival[i]), int(first[i])
        mid = (a + f) // 2
        if i % 7 == 3:
            continue  # no spans at all
        if i % 5:
            gap = 1 if i % 6 == 0 else 0
            rows += [(i, "state", "queue", a, mid), (i, "state", "prefill", mid + gap, f),
                     (i, "state", "decode", f, f + 40)]
        rows += [(i, "activity", "h2d", a + 1, mid + 3), (i, "activity", "lookup", a, a + 2),
                 (i, "step", "step", a, f)]
    order = rng.permutation(len(rows))
    rows = [rows[k] for k in order]
    spans = pd.DataFrame({
        "request_num": pd.array([r[0] for r in rows], dtype="Int64"),
        "kind": pd.array([r[1] for r in rows], dtype="str"),
        "name": pd.array([r[2] for r in rows], dtype="str"),
        "start_ns": np.array([r[3] for r in rows], dtype=np.int64),
        "end_ns": np.array([r[4] for r in rows], dtype=np.int64),
    })
    return pd.DataFrame(req), spans


def _variants() -> dict[str, tuple[pd.DataFrame, pd.DataFrame]]:
    req, spans = _frames()
    out = {"arrow": (req, spans)}
    out["object"] = (req, spans.astype({"kind": object, "name": object}))
    out["categorical"] = (req, spans.astype({"kind": "category", "name": "category"}))
    out["int64 nums"] = (req.astype({"request_num": "Int64"}),
                         spans.astype({"request_num": np.int64}))
    out["plain first token"] = (req.astype({"first_token_ns": np.int64,
                                            "finish_ns": np.int64}), spans)
    out["nullable accounting"] = (req.astype({c: "Int64" for c in ACCOUNTING_COLUMNS}), spans)
    return out


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert list(a.dtypes) == list(b.dtypes)


@pytest.mark.parametrize("name", list(_variants()))
def test_the_analysis_is_the_same_over_input_dtypes(name: str) -> None:
    base_req, base_spans = _variants()["arrow"]
    req, spans = _variants()[name]
    want = partition(base_req, base_spans)
    got = partition(req, spans)
    if name == "plain first token":  # the same values; Int64 either way in the output
        got = got.astype({c: want[c].dtype for c in got.columns})
    _same(got, want)
    assert want["violation"].notna().any() and want["derived"].any()
    for by in (None, "tenant", "derived"):
        s, t = summarize(got, by), summarize(want, by)
        for frame in ("stages", "slowest", "windows"):
            _same(getattr(s, frame), getattr(t, frame))
        assert (s.requests, s.derived, s.violations) == (t.requests, t.derived, t.violations)
    a, b = token_accounting(req), token_accounting(base_req)
    assert a.to_dict() == b.to_dict()
    for frame in ("tiers", "failures", "identity_violations"):
        _same(getattr(a, frame), getattr(b, frame))


def test_requests_without_spans_and_empty_frames() -> None:
    req, spans = _frames(12)
    none = partition(req, spans.iloc[:0])
    assert none["derived"].all() and (none["other_ns"] == none["ttft_ns"]).all()
    empty = partition(req.iloc[:0], spans.iloc[:0])
    assert len(empty) == 0 and list(empty.columns) == list(none.columns)
    assert summarize(empty).requests == 0
    assert token_accounting(req.iloc[:0]).requests == 0


@pytest.mark.parametrize("first_dtype", ["Int64", "int64"])
def test_no_output_column_shares_memory_with_the_input(first_dtype: str) -> None:
    req, spans = _frames(20)
    req = req.astype({"first_token_ns": first_dtype})  # Int64 without nulls: its own buffer
    before_req, before_spans = req.copy(), spans.copy()
    part = partition(req, spans)
    summarize(part)
    token_accounting(req)
    keep = part.copy()
    for c in ("first_token_ns", "arrival_ns", "ttft_ns", "e2e_ns", "queue_ns"):
        part.loc[0, c] = 123
    part.loc[0, "request_id"] = "zzz"
    _same(req, before_req)
    _same(spans, before_spans)
    assert part.loc[1].tolist() == keep.loc[1].tolist()
