"""Importers' frames built as Arrow tables from buffers: the same arrays `pa.array` builds, the
same DataFrames as the frame builders, converted only when read; a Kineto import whose caller
reads no frame never loads pandas."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers.importers import ImportedRun
from analyzers.importers.base import (
    _array,
    concat_span_tables,
    concat_spans,
    frame_of,
    requests_frame,
    requests_table,
    spans_frame,
    spans_table,
)
from tests.analyzers.importers.fixtures import T0, ann, kineto_trace

REPO = Path(__file__).resolve().parents[3]

_INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
_INT32 = st.integers(-(1 << 31), (1 << 31) - 1)


def _old_array(values: Any, typ: pa.DataType) -> pa.Array:
    """`_array` as it was, with `pa.array` (the reference)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iuf" and pa.types.is_integer(typ):
        return pa.array(values.astype(np.int64, copy=False)).cast(typ)
    return pa.array(values, type=typ, from_pandas=True)


def _same(values: Any, typ: pa.DataType) -> None:
    try:
        want = _old_array(values, typ)
    except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
        with pytest.raises(type(exc)):
            _array(values, typ, len(values))
        return
    got = _array(values, typ, len(values))
    assert got.type == want.type and got.equals(want)
    assert got.null_count == want.null_count
    got.validate(full=True)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.none(), _INT64), max_size=40))
def test_int64_lists_as_pa_array(values: list[int | None]) -> None:
    _same(values, pa.int64())
    _same(tuple(values), pa.int64())
    _same(np.array(values, dtype=object), pa.int64())


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.none(), _INT32, st.integers(-(1 << 40), 1 << 40)), max_size=40))
def test_int32_lists_as_pa_array_out_of_range_refused_alike(values: list[int | None]) -> None:
    _same(values, pa.int32())


@settings(max_examples=80, deadline=None)
@given(st.lists(_INT64, max_size=40), st.sampled_from([np.int64, np.int32, np.uint8, np.float64]))
def test_numpy_arrays_as_pa_array(values: list[int], dtype: Any) -> None:
    arr = np.array(values, dtype=object)
    if dtype is not np.int64:
        info = np.iinfo(dtype) if dtype is not np.float64 else None
        arr = np.array([v if info is None else min(max(v, info.min), info.max)
                        for v in values], dtype=dtype)
    else:
        arr = arr.astype(np.int64)
    _same(arr, pa.int64())
    _same(arr, pa.int32())
    _same(arr[::2], pa.int64())  # not contiguous


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=8)), max_size=40))
def test_strings_as_pa_array(values: list[str | None]) -> None:
    _same(values, pa.string())
    _same(np.array(values, dtype=object), pa.string())


@pytest.mark.parametrize("values, typ", [
    ([True, None, 3], pa.int64()), ([1.0, None], pa.int64()), ([float("nan"), 2], pa.int64()),
    ([np.int64(4), None], pa.int64()), (["a", 1], pa.string()),
    (["a", float("nan")], pa.string()), (["\ud800"], pa.string()), ([1 << 64], pa.int64()),
    ([None, None], pa.int32()), ([], pa.string()), (np.array(["a", "b"]), pa.string()),
    (np.array([1.5, 2.0]), pa.int64()),
])
def test_other_values_go_through_pa_array_as_before(values: Any, typ: pa.DataType) -> None:
    _same(values, typ)


def _span_cols(n: int, offset: int) -> dict[str, Any]:
    return {"request_id": [None if i % 3 == 0 else f"r{i}" for i in range(n)],
            "request_num": np.arange(n) + offset, "kind": ["state"] * n,
            "name": np.array(["queue", "prefill"] * (n // 2) + ["queue"] * (n % 2), dtype=object),
            "start_ns": np.arange(n, dtype=np.int64) * 10 + T0,
            "end_ns": np.arange(n, dtype=np.int64) * 10 + T0 + 5,
            "bytes": [None if i % 2 else i * 4096 for i in range(n)],
            "step_id": [i if i % 4 else None for i in range(n)], "clock": ["cpu"] * n}


@pytest.mark.parametrize("sizes", [(), (0,), (3,), (4, 0, 5), (0, 0)])
def test_span_tables_convert_to_the_frames_concat_spans_gives(sizes: tuple[int, ...]) -> None:
    cols = [_span_cols(n, 100 * k) for k, n in enumerate(sizes)]
    old = concat_spans([spans_frame(c, n) for c, n in zip(cols, sizes, strict=True)])
    new = frame_of("spans", concat_span_tables(
        [spans_table(c, n) for c, n in zip(cols, sizes, strict=True)]))
    pd.testing.assert_frame_equal(new, old, check_exact=True)
    assert list(new.dtypes) == list(old.dtypes)


def test_requests_table_converts_to_requests_frame() -> None:
    cols = {"request_id": ["a", "b"], "request_num": np.array([3, 4]),
            "arrival_ns": np.array([T0, T0 + 1]), "first_token_ns": [T0 + 9, None],
            "finish_ns": np.array([T0 + 9, T0 + 20]), "status": ["ok", "ok"]}
    old = requests_frame(cols, 2)
    new = frame_of("requests", requests_table(cols, 2))
    pd.testing.assert_frame_equal(new, old, check_exact=True)
    assert str(new["first_token_ns"].dtype) == "Int64" and new["first_token_ns"].isna()[1]


def test_imported_run_converts_a_table_once_when_read(tmp_path: Path) -> None:
    run = ImportedRun.empty("kineto", tmp_path / "t.json")
    run.spans = spans_table(_span_cols(3, 0), 3)
    assert isinstance(run.__dict__["spans"], pa.Table)
    assert run.rows("spans") == 3 and run.rows("requests") == 0
    assert run.to_dict()["spans"] == 3
    assert isinstance(run.__dict__["spans"], pa.Table)  # counting built no frame
    df = run.spans
    assert isinstance(df, pd.DataFrame) and run.spans is df  # converted once, then kept
    assert list(df.columns) == list(spans_frame({}, 0).columns)
    assert run.requests.empty and list(run.requests.columns) == list(requests_frame({}, 0).columns)
    frame = spans_frame(_span_cols(2, 0), 2)
    run.spans = frame  # a DataFrame is kept as it is (the other importers set frames)
    assert run.spans is frame and run.rows("spans") == 2
    with pytest.raises(TypeError):
        ImportedRun("kineto", tmp_path)  # type: ignore[call-arg]  # the frames stay required


_NO_PANDAS = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from analyzers.importers import load
run = load(Path(sys.argv[1]))
assert run.rows("requests") == 2 and run.rows("spans") > 0, run.to_dict()
assert "pandas" not in sys.modules, "load imported pandas"
assert "pyarrow.compute" not in sys.modules, "load imported pyarrow.compute"
in_run = any("from the run store" in d for d in run.derived)
assert in_run == (sys.argv[3] == "True"), run.derived
run.to_dict()
assert "pandas" not in sys.modules, "to_dict imported pandas"
assert len(run.spans) == run.rows("spans")
assert "pandas" in sys.modules
"""


@pytest.mark.parametrize("in_run", [False, True])
def test_kineto_import_without_frames_read_never_loads_pandas(tmp_path: Path, in_run: bool
                                                              ) -> None:
    where = tmp_path
    if in_run:  # request ids from the run store beside the trace: read without pandas too
        from agent.clock import ClockAnchor
        from agent.runstore import RunStoreWriter
        from agent.telemetry import Recorder, RequestAccounting

        rec = Recorder(anchor=ClockAnchor(wall_ns=0, mono_ns=0), nvtx=False)
        for i in range(5):
            rn = rec.request_begin(f"docqa-{i:05d}", 10)
            rec.request_end(rn, RequestAccounting(), t=20)
        w = RunStoreWriter(tmp_path / "run", config={})
        w.write_all(rec.drain())
        w.close()
        where = tmp_path / "run" / "profile"
        where.mkdir()
    events = [ann("kvscope.lookup#3", 0, 10), ann("kvscope.queue#3", 10, 40),
              ann("kvscope.prefill#3", 50, 40), ann("kvscope.queue#4", 5, 10),
              ann("kvscope.prefill#4", 15, 10), ann("kvscope.forward#12", 60, 40),
              ann("kvscope.prefetch#3", 5, 10),
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)",
               "ts": 35.5, "dur": 20, "args": {"bytes": 8192, "correlation": 99}},
              {"ph": "X", "cat": "kernel", "name": "k", "ts": 40, "dur": 3}]
    trace = kineto_trace(where, events, base_ns=T0)
    subprocess.run([sys.executable, "-c", _NO_PANDAS, str(trace), str(REPO), str(in_run)],
                   check=True, cwd=tmp_path)
