"""The spans frame `frame_of` builds in one conversion is the frame the run store's `to_pandas`
gives (dtypes, values, index, column order, list cells, writable columns); a Kineto import read
outside a run store builds its frames without the run-store reader (nor pyarrow.parquet); the
typed decode's one-pass value codes keep the order values are first seen in; the trace is read
on a thread beside the run store's requests, and its errors come out as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import analyzers.importers.kineto as kineto
from agent.errors import InputError
from agent.runstore.reader import to_pandas
from agent.schema import SPANS_SCHEMA
from analyzers.importers import load
from analyzers.importers.base import concat_span_tables, frame_of, spans_table
from tests.analyzers.importers.fixtures import T0, ann, kineto_trace

REPO = Path(__file__).resolve().parents[3]


def _cols(n: int, offset: int = 0) -> dict[str, Any]:
    """Every SPANS_SCHEMA column, nulls in each nullable one."""
    def some(values: list[Any]) -> list[Any]:
        return [None if i % 3 == 1 else v for i, v in enumerate(values)]

    return {
        "request_id": some([f"r{i + offset}" for i in range(n)]),
        "request_num": some([i + offset for i in range(n)]),
        "kind": ["state", "activity"] * (n // 2) + ["step"] * (n % 2),
        "name": [f"n{i % 4}" for i in range(n)],
        "start_ns": np.arange(n, dtype=np.int64) * 10 + T0 + offset,
        "end_ns": np.arange(n, dtype=np.int64) * 10 + T0 + offset + 5,
        "tier": some(["host"] * n), "layer": some(list(range(n))),
        "tokens": some([16 * i for i in range(n)]),
        "bytes": some([(1 << 62) + i for i in range(n)]),
        "step_id": some([-i for i in range(n)]), "transfer_id": some(list(range(n))),
        "waits_on": some([[i, i + 1] if i % 2 else [] for i in range(n)]),
        "clock": ["cpu"] * n, "batch_requests": some([2] * n), "block": some([-(1 << 31)] * n),
    }


def _assert_identical(new: pd.DataFrame, old: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(new, old, check_exact=True)
    assert list(new.columns) == list(old.columns) == SPANS_SCHEMA.names
    assert list(new.dtypes) == list(old.dtypes)
    assert type(new.index) is type(old.index) and new.index.equals(old.index)
    for c in new.columns:
        assert type(new[c].array) is type(old[c].array), c
        if new[c].dtype == object:  # the list column: cells of the same type and values
            for a, b in zip(new[c], old[c], strict=True):
                assert type(a) is type(b), c
                if a is not None:
                    assert a.dtype == b.dtype and np.array_equal(a, b), c
        if isinstance(new[c].dtype, np.dtype) and new[c].dtype.kind == "i":
            assert new[c].to_numpy().flags.writeable == old[c].to_numpy().flags.writeable


@pytest.mark.parametrize("sizes", [(0,), (1,), (7,), (4, 0, 5), (3, 3)])
def test_spans_frame_is_what_to_pandas_gives(sizes: tuple[int, ...]) -> None:
    tbl = concat_span_tables([spans_table(_cols(n, 100 * k), n) for k, n in enumerate(sizes)])
    _assert_identical(frame_of("spans", tbl), to_pandas(tbl, SPANS_SCHEMA))


def test_spans_frame_of_another_shape_goes_through_to_pandas() -> None:
    tbl = spans_table(_cols(5), 5)
    shuffled = tbl.select(list(reversed(tbl.column_names)))  # not the schema's order
    pd.testing.assert_frame_equal(frame_of("spans", shuffled), to_pandas(tbl, SPANS_SCHEMA),
                                  check_exact=True)
    nulls = tbl.set_column(tbl.schema.get_field_index("start_ns"), SPANS_SCHEMA.field(
        "start_ns"), pa.array([None, 1, 2, 3, 4], type=pa.int64()))  # a null where none may be
    new, old = frame_of("spans", nulls), to_pandas(nulls, SPANS_SCHEMA)
    pd.testing.assert_frame_equal(new, old, check_exact=True)
    assert new["start_ns"].dtype == old["start_ns"].dtype


_NO_READER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from analyzers.importers import load
run = load(Path(sys.argv[1]))
assert len(run.spans) == run.rows("spans") > 0 and len(run.requests) == 2
assert "agent.runstore.reader" not in sys.modules, "the frames imported the run-store reader"
assert "pyarrow.parquet" not in sys.modules, "the frames imported pyarrow.parquet"
"""


def test_kineto_frames_outside_a_run_store_need_no_reader(tmp_path: Path) -> None:
    events = [ann("kvscope.lookup#3", 0, 10), ann("kvscope.queue#3", 10, 40),
              ann("kvscope.prefill#4", 15, 10), ann("kvscope.forward#12", 60, 40)]
    trace = kineto_trace(tmp_path, events, base_ns=T0)
    subprocess.run([sys.executable, "-c", _NO_READER, str(trace), str(REPO)], check=True,
                   cwd=tmp_path)


@pytest.mark.parametrize("values", [[], ["X"], ["X", "M", "X", None, "M", "s", "X"],
                                    [None, None], ["b", "a", "b", "c", "a"],
                                    [("X", "cpu_op"), ("M", None), ("X", "kernel"),
                                     ("X", "cpu_op"), ("s", "ac2g")]])
def test_codes_in_the_order_first_seen(values: list[Any]) -> None:
    codes, distinct = kineto._codes(iter(values), len(values))
    assert distinct == list(dict.fromkeys(values))
    assert codes.dtype == np.int32 and [distinct[c] for c in codes] == values
    firsts = [v[0] if isinstance(v, tuple) else v for v in distinct]  # a value may repeat
    for v in [*firsts, "absent"]:
        assert kineto._is(codes, firsts, v).tolist() == [
            (x[0] if isinstance(x, tuple) else x) == v for x in values]


def test_read_errors_come_out_after_the_run_store_read(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    (run / "run.json").write_text("{not json")  # not a readable store: ids fall back
    missing = run / "profile" / "torch_trace.json"
    with pytest.raises(InputError, match="no such file"):
        kineto.load_kineto(missing)
    cut = run / "profile" / "cut.json.gz"
    cut.write_bytes(kineto_trace(tmp_path, [ann("kvscope.queue#1", 0, 5)]).read_bytes()[:-9])
    with pytest.raises(InputError, match="truncated gzip"):
        load(cut)


def test_work_beside_the_read_fails_as_it_would_alone(tmp_path: Path) -> None:
    p = kineto_trace(tmp_path, [ann("kvscope.queue#1", 0, 5)])

    def boom() -> None:
        raise RuntimeError("work failed")

    with pytest.raises(RuntimeError, match="work failed"):
        kineto._read_beside(p, boom)
    data, res = kineto._read_beside(p, lambda: 7)
    assert res == 7 and data == kineto.read_bytes(p)


def test_read_beside_without_a_thread_reads_after_the_work(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    p = kineto_trace(tmp_path, [ann("kvscope.queue#1", 0, 5)])

    def no_thread(self: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(kineto.threading.Thread, "start", no_thread)
    data, res = kineto._read_beside(p, lambda: 7)
    assert res == 7 and data == kineto.read_bytes(p)
    with pytest.raises(InputError, match="no such file"):
        kineto._read_beside(tmp_path / "absent.json", lambda: None)
