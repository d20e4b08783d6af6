"""`analyzers.frames` string helpers on run-store columns left in their read chunks (one per
part) and in Arrow's ``string`` type give what they give on one ``large_string`` array."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from analyzers import frames as F


def _chunked(values: list[str | None], typ: pa.DataType) -> pd.Series:
    arr = pa.chunked_array([pa.array(values[:3], typ), pa.array(values[3:], typ)])
    return pd.Series(pd.arrays.ArrowExtensionArray(arr))


VALUES = ["step", "state", None, "activity", "state", "step", None]


def test_helpers_same_on_chunks_and_types() -> None:
    plain = pd.Series(VALUES, dtype=object)
    for typ in (pa.string(), pa.large_string()):
        col = _chunked(VALUES, typ)
        assert F.equals(col, "state").tolist() == F.equals(plain, "state").tolist()
        c_idx, c_vals = F.categorize(col)
        p_idx, p_vals = F.categorize(plain)
        decoded = [None if i < 0 else c_vals[i] for i in c_idx]
        assert decoded == [None if i < 0 else p_vals[i] for i in p_idx] == VALUES
        req = _chunked(["state", "x", "step", "activity"], typ)
        got = F.request_index(col, req)
        assert got.tolist() == F.request_index(plain, pd.Series(
            ["state", "x", "step", "activity"], dtype=object)).tolist()
        assert got.tolist() == [2, 0, -1, 3, 0, 2, -1]


def test_empty_and_all_null_columns() -> None:
    empty = pd.Series([], dtype=object)
    assert F.equals(empty, "x").tolist() == []
    idx, vals = F.categorize(pd.Series([None, None], dtype=object))
    assert idx.tolist() == [-1, -1] and vals == []
    assert F.request_index(pd.Series([None], dtype=object),
                           pd.Series(["a"], dtype=object)).dtype == np.int64
