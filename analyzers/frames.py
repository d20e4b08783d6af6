"""Column helpers shared by the analyzers: run-store DataFrames → numpy / Arrow, vectorised.

Run-store frames (``agent.runstore.open_run``) hold nullable integers as pandas ``Int64`` and
strings as Arrow-backed ``str``; hand-built frames in tests may use plain ``int64`` and
``object``. These helpers accept both and never loop over rows in Python.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from agent.errors import InputError
from agent.schema import TTFT_STAGES

if TYPE_CHECKING:
    import pandas as pd


class _Pandas:
    """The pandas module, looked up at each use (``pd.DataFrame``): the analyzers' modules
    name it `pd` without importing it when they load, and `_start_pandas_import` imports it
    on a thread meanwhile. A use before that import is done waits for it (Python's import
    lock for the module); afterwards a use is one ``sys.modules`` look-up."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        import pandas

        return getattr(pandas, name)


#: pandas for the analyzers (`_Pandas`): ``from analyzers.frames import PANDAS as pd``.
PANDAS: Any = _Pandas()
_pandas_import: threading.Thread | None = None


def _import_pandas() -> None:
    try:
        import pandas  # noqa: F401
    except BaseException:
        pass  # a use imports it again and raises there


def _wait_for_pandas_import() -> None:
    """Before a fork: let the background import finish (a child must not inherit its locks)."""
    t = _pandas_import
    if t is not None and t is not threading.current_thread():
        t.join()


def _start_pandas_import() -> None:
    """Import pandas on a thread while the caller goes on (e.g. `open_run` decoding Parquet,
    which Arrow does without the GIL): about a third of a second of a fresh process's
    analysis overlapped. Nothing when pandas is imported already."""
    global _pandas_import
    if "pandas" in sys.modules:
        return
    os.register_at_fork(before=_wait_for_pandas_import)
    _pandas_import = threading.Thread(target=_import_pandas, name="kvscope-import-pandas")
    _pandas_import.start()


_start_pandas_import()

#: The partition's stage columns, in `TTFT_STAGES` order.
STAGE_COLUMNS: tuple[str, ...] = tuple(f"{s}_ns" for s in TTFT_STAGES)

#: The quantile definition every analyzer uses: numpy's default (linear interpolation between
#: order statistics), the same as pandas' ``quantile``.
QUANTILE_METHOD = "linear"


def arrow_strings(col: pd.Series) -> pa.Array | pa.ChunkedArray:
    """A string column as Arrow ``string`` or ``large_string`` data, zero-copy for Arrow-backed
    columns: a run store's columns stay in the chunks they were read in (one per part) and in
    their own string type, since joining the chunks or casting copies every string. Other
    columns (``object``, all-null) become one ``large_string`` array."""
    arr = pa.array(col.array) if len(col) else pa.array([], pa.large_string())
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = arr.cast(pa.large_string())
    return arr


def _array(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


def ints(col: pd.Series, fill: int = -1) -> np.ndarray:
    """An integer column as ``int64`` numpy, nulls replaced by `fill`.

    Always with numpy's own int64 descriptor: an array converted from Arrow can carry an
    equal but distinct one, which every result computed from it inherits and which sends
    ``np.add.at`` and the other ``ufunc.at`` down their generic path (~25x slower)."""
    # NOTE: a plain int64 column's array may be a read-only view; callers never write into it
    out = (col.to_numpy() if col.dtype == np.int64
           else col.to_numpy(dtype=np.int64, na_value=fill))
    return out if out.dtype is _INT64 else out.view(_INT64)


_INT64 = np.dtype(np.int64)


def ints_at(col: pd.Series, rows: np.ndarray, fill: int = -1) -> np.ndarray:
    """``ints(col, fill)[rows]`` (`rows`: integer positions), the rows gathered before they
    are converted: no array as long as the whole column is made (a run's spans frame has
    millions of rows, of which a caller often reads a third)."""
    arr = col.array
    data, mask = getattr(arr, "_data", None), getattr(arr, "_mask", None)
    if col.dtype == np.int64 or not (isinstance(data, np.ndarray) and
                                     isinstance(mask, np.ndarray) and data.dtype.kind == "i"
                                     and mask.dtype == np.bool_ and
                                     data.shape == mask.shape == (len(col),)):
        out = ints(col, fill)[rows]  # a plain int64 column (a view), or another kind
    else:  # a nullable Int64 / Int32 column (pandas' masked array: values and null mask)
        out = data.take(rows).astype(np.int64, copy=False)
        out[mask.take(rows)] = fill
    return out if out.dtype is _INT64 else out.view(_INT64)


def valid(col: pd.Series) -> np.ndarray:
    """Boolean mask of the non-null entries of `col` (`Series.notna`, from its array: no
    Series built)."""
    return ~np.asarray(col.array.isna(), dtype=bool)


def categorize(col: pd.Series) -> tuple[np.ndarray, list[str | None]]:
    """Dictionary-encode a low-cardinality string column in one pass.

    Returns:
        ``(codes, values)``: int64 index of each row into `values` (-1 for null).
    """
    enc = pc.dictionary_encode(arrow_strings(col))
    if isinstance(enc, pa.ChunkedArray):  # one dictionary for all the chunks
        enc = enc.unify_dictionaries()
        dictionary = (enc.chunk(0).dictionary if enc.num_chunks
                      else pa.array([], pa.large_string()))
        chunks = [c.indices for c in enc.chunks]
    else:
        dictionary, chunks = enc.dictionary, [enc.indices]
    # Each chunk's int32 codes widened straight into the result (nulls as -1).
    idx = np.empty(sum(len(c) for c in chunks), dtype=np.int64)
    at = 0
    for c in chunks:
        idx[at:at + len(c)] = (c if not c.null_count else pc.fill_null(c, -1)).to_numpy(
            zero_copy_only=False)
        at += len(c)
    return idx, dictionary.to_pylist()


def recode(codes_values: tuple[np.ndarray, list[str | None]],
           mapping: Mapping[str, int] | Sequence[str]) -> np.ndarray:
    """Map `categorize` output through `mapping` (value → int, or a vocabulary → its index);
    values it lacks, and nulls, become -1."""
    idx, values = codes_values
    if not isinstance(mapping, Mapping):
        mapping = {v: i for i, v in enumerate(mapping)}
    table = np.array([mapping.get(v, -1) if v is not None else -1 for v in values] + [-1],
                     dtype=np.int64)
    return table[idx]  # idx -1 picks the trailing -1


def request_index(span_ids: pd.Series, request_ids: pd.Series) -> np.ndarray:
    """Row of `request_ids` that each entry of `span_ids` names (-1 for null or unknown).

    A hash join in Arrow's C++ kernels: about 20 M lookups/s, no sort.
    """
    spans = arrow_strings(span_ids)
    values = _array(arrow_strings(request_ids))
    if values.type != spans.type:
        values = values.cast(spans.type)
    idx = pc.index_in(spans, value_set=values)
    return pc.fill_null(idx, -1).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def rows(df: pd.DataFrame, mask: np.ndarray | pd.Series, columns: Sequence[str]
         ) -> pd.DataFrame:
    """``df.loc[mask]`` narrowed to those of `columns` it has: the same rows and values in
    the columns a caller reads, without copying the others (a run's spans frame has 14)."""
    return df.loc[mask, [c for c in columns if c in df.columns]]


def require_columns(df: pd.DataFrame, columns: Sequence[str], table: str) -> None:
    """Raise `InputError` naming `table` when `df` lacks any of `columns`."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise InputError(f"{table}: missing column(s) {', '.join(missing)}")


def equals(col: pd.Series, value: str) -> np.ndarray:
    """Boolean mask of the rows of a string column equal to `value` (null rows: False).

    A byte comparison per row: cheaper than hashing when only one or two values matter.
    For an Arrow-backed column (a run store's) the mask is computed once per column and
    value and kept while the column's data lives (the consistency check, the diagnoses and
    the accounting ask for the same few: ``kind == "ledger"``, ``kind == "activity"``):
    such a mask is read-only; one for a caller to write into is ``equals(...).copy()``.
    """
    arr = arrow_strings(col)
    cached = isinstance(arr, pa.ChunkedArray) and getattr(col.array, "_pa_array", None) is arr
    if cached:
        got = _equals_cached(arr, value)
        if got is not None:
            return got
    eq = pc.fill_null(pc.equal(arr, pa.scalar(value, arr.type)), False).to_numpy(
        zero_copy_only=False)
    if cached:
        eq.flags.writeable = False
        _equals_keep(arr, value, eq)
    return eq


#: `equals` masks by the Arrow data they were computed from: ``id(data) → (weak reference
#: to it, {value: mask})``, each entry dropped when its data is freed.
_EQUALS: dict[int, tuple[Any, dict[str, np.ndarray]]] = {}
_EQUALS_LOCK = threading.RLock()  # (a weak reference's callback may run under it)


def _equals_cached(arr: pa.ChunkedArray, value: str) -> np.ndarray | None:
    with _EQUALS_LOCK:
        entry = _EQUALS.get(id(arr))
        if entry is None or entry[0]() is not arr:
            return None
        return entry[1].get(value)


def _equals_keep(arr: pa.ChunkedArray, value: str, mask: np.ndarray) -> None:
    import weakref

    key = id(arr)
    with _EQUALS_LOCK:
        entry = _EQUALS.get(key)
        if entry is None or entry[0]() is not arr:
            def drop(ref: Any, key: int = key) -> None:
                with _EQUALS_LOCK:
                    if key in _EQUALS and _EQUALS[key][0] is ref:
                        del _EQUALS[key]

            entry = (weakref.ref(arr, drop), {})
            _EQUALS[key] = entry
        entry[1][value] = mask


def require_unique_ids(requests: pd.DataFrame) -> None:
    """Raise `InputError` when a request id appears twice (joins would be ambiguous)."""
    ids = arrow_strings(requests["request_id"])
    if len(pc.unique(ids)) == len(ids):
        return
    dup = requests["request_id"].duplicated(keep=False)
    if dup.any():
        names = sorted(set(requests.loc[dup, "request_id"].astype(str)))[:5]
        raise InputError(f"requests: duplicate request_id(s) {', '.join(names)}")


def nums_name_ids(spans: pd.DataFrame, requests: pd.DataFrame) -> bool:
    """Whether the int64 ``request_num`` can stand for the string ``request_id`` in matching
    spans to requests: both frames carry both columns, every request has a number and no two
    share one, and the spans' numbers are null exactly where their ids are (as a run store
    writes a span's request_num with its request_id)."""
    if not {"request_id", "request_num"} <= set(spans.columns) or \
            not {"request_id", "request_num"} <= set(requests.columns) or \
            not valid(requests["request_num"]).all():
        return False
    nums = ints(requests["request_num"])
    return n_distinct(nums) == len(nums) and np.array_equal(valid(spans["request_num"]),
                                                            valid(spans["request_id"]))


def n_distinct(a: np.ndarray) -> int:
    """``len(np.unique(a))`` of an array, for a 1-D bool, integer or float one by one sort
    and a count of the changes (np.unique also builds the unique array: 10-20 % slower on a
    large run's hundred thousand values); any other array, and one holding NaN, goes to
    np.unique itself (which counts every NaN as one value)."""
    if not len(a):
        return 0
    if a.dtype.kind not in "biuf" or a.ndim != 1 or (a.dtype.kind == "f"
                                                      and np.isnan(a).any()):
        return len(np.unique(a))
    s = np.sort(a)
    return 1 + int(np.count_nonzero(s[1:] != s[:-1]))


def group_sums(group: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Exact ``int64`` sums of `values` per group id in ``[0, n_groups)`` (unsorted input)."""
    out = np.zeros(n_groups, dtype=np.int64)
    np.add.at(out, group, values)
    return out


