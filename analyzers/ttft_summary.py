"""Aggregates of a TTFT partition: per-stage percentiles and shares, the slowest requests, and
percentiles over time windows — optionally per tenant, workload class or hit class.

Percentiles use numpy's default definition (linear interpolation between order statistics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.errors import InputError
from agent.schema import TTFT_STAGES
from analyzers import frames as F

if TYPE_CHECKING:
    import pandas as pd
else:  # imported on a thread while the caller reads (see `analyzers.frames`)
    pd = F.PANDAS

QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)
_QCOLS = ("p50_ns", "p90_ns", "p99_ns")
#: What `summarize` reports on, besides the stages.
EXTRA_ROWS: tuple[str, ...] = ("ttft", "hidden_load")
GROUPABLE: tuple[str, ...] = ("tenant", "workload_class", "hit_class", "status", "derived")
# Candidate window lengths: 1-2-5 steps from 1 ms to about a day.
_NICE_WINDOWS_NS = tuple(m * 10**e for e in range(6, 14) for m in (1, 2, 5))


@dataclass(slots=True, frozen=True)
class TTFTSummary:
    """What `summarize` returns.

    Attributes:
        requests: requests with a first token (the population of every figure).
        without_first_token: requests excluded because they never produced a first token.
        derived: requests whose stages come from the activity sweep line.
        violations: requests whose spans broke the partition rules (see ``partition``).
        by: the grouping columns (empty for the whole run).
        stages: one row per (group,) stage, ``ttft`` and ``hidden_load``: ``requests, p50_ns,
            p90_ns, p99_ns, mean_ns, total_ns``, ``share_mean`` (mean over requests of the
            stage's share of that request's TTFT) and ``share_of_total`` (``total_ns`` over the
            summed TTFT).
        slowest: per (group,) stage, the requests at or above the p99 TTFT: ``threshold_ns``,
            ``requests``, ``mean_ns`` and ``share`` (of their summed TTFT; sums to 1).
        windows: per window of ``window_ns`` by arrival, counted from the run's start:
            ``window_start_ns`` (epoch), ``window_start_s`` (since the start), ``requests`` and
            ``ttft``/stage ``p50_ns``/``p90_ns``/``p99_ns`` as ``<name>_p50_ns`` columns.
        window_ns: the window length.
    """

    requests: int
    without_first_token: int
    derived: int
    violations: int
    by: tuple[str, ...]
    stages: pd.DataFrame
    slowest: pd.DataFrame
    windows: pd.DataFrame
    window_ns: int

    def stage(self, name: str) -> dict[str, Any]:
        """The `stages` row of `name` for an ungrouped summary, as a dict."""
        row = self.stages.loc[self.stages["stage"] == name]
        return {k: _py(v) for k, v in row.iloc[0].items()} if len(row) else {}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``{requests, without_first_token, derived, violations, by,
        window_ns, stages: [row...], slowest: [row...], windows: [row...]}``."""
        return {
            "requests": self.requests,
            "without_first_token": self.without_first_token,
            "derived": self.derived,
            "violations": self.violations,
            "by": list(self.by),
            "window_ns": self.window_ns,
            "stages": records(self.stages),
            "slowest": records(self.slowest),
            "windows": records(self.windows),
        }


def _py(v: Any) -> Any:
    """numpy/pandas scalar → plain Python (NaN/NA → None) for JSON."""
    if v is None or v is pd.NA:
        return None
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return None if np.isnan(v) else float(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows of `df` as JSON-ready dicts, column order kept."""
    cols = list(df.columns)
    return [{c: _py(v) for c, v in zip(cols, row, strict=True)}
            for row in df.itertuples(index=False, name=None)]


def default_window_ns(arrival_ns: np.ndarray) -> int:
    """A round window length giving about ten windows over the arrivals."""
    if len(arrival_ns) == 0:
        return _NICE_WINDOWS_NS[0]
    span = int(arrival_ns.max() - arrival_ns.min())
    for w in _NICE_WINDOWS_NS:
        if w * 10 >= span:
            return w
    return _NICE_WINDOWS_NS[-1]


def _values(served: pd.DataFrame) -> pd.DataFrame:
    """int64 stage/ttft/hidden columns plus per-stage shares of TTFT (NaN when TTFT is 0).

    Built column by column from 1-D arrays, so every column stays contiguous (the quantiles
    below partition each column in place of a strided one).
    """
    names = [*TTFT_STAGES, *EXTRA_ROWS]
    cols = [*F.STAGE_COLUMNS, "ttft_ns", "hidden_load_ns"]
    data = {name: F.ints(served[c], 0) for name, c in zip(names, cols, strict=True)}
    ttft = data["ttft"].astype(np.float64)
    inv = np.divide(1.0, ttft, out=np.full(len(ttft), np.nan), where=ttft > 0)
    for name in names:
        data[f"share:{name}"] = data[name] * inv
    return pd.DataFrame(data, index=served.index, copy=False)


def _group_keys(served: pd.DataFrame, by: tuple[str, ...]) -> list[pd.Series]:
    return [served[c].astype(object).where(served[c].notna(), "(none)") for c in by]


def summarize(
    part: pd.DataFrame,
    by: str | Sequence[str] | None = None,
    *,
    window_ns: int | None = None,
    origin_ns: int | None = None,
) -> TTFTSummary:
    """Aggregate a partition (the output of ``partition``).

    Args:
        part: the partition frame.
        by: optional grouping column(s): ``tenant``, ``workload_class``, ``hit_class``,
            ``status`` or ``derived``.
        window_ns: window length for percentiles over time (default: a round length giving
            about ten windows).
        origin_ns: the run's time origin (`analyzers.timebase.run_origin_ns`): windows are
            ``[origin + k * window, origin + (k + 1) * window)``; default the first arrival.

    Returns:
        a `TTFTSummary`; requests without a first token are counted, not aggregated.
    """
    by_t: tuple[str, ...] = () if by is None else ((by,) if isinstance(by, str) else tuple(by))
    for c in by_t:
        if c not in GROUPABLE or c not in part:
            raise InputError(f"--by {c}: expected one of {', '.join(GROUPABLE)}")
    if window_ns is not None and window_ns <= 0:
        raise InputError(f"window_ns: must be > 0, got {window_ns}")
    has_ft = valid_column(part, "ttft_ns")
    if not by_t:
        return _summarize_all(part, has_ft, window_ns, origin_ns)
    served = part.loc[has_ft]
    vals = _values(served)
    keys = _group_keys(served, by_t) if by_t else [pd.Series("all", index=served.index)]
    names = [*TTFT_STAGES, *EXTRA_ROWS]
    stages = _stage_table(vals, keys, names, by_t)
    slowest = _slowest(vals, keys, by_t)
    arrival = F.ints(served["arrival_ns"])
    w = window_ns or default_window_ns(arrival)
    origin = origin_ns if origin_ns is not None else (int(arrival.min()) if len(arrival) else 0)
    windows = _windows(vals, arrival, w, origin)  # each of the three tidied (`_tidy`)
    return TTFTSummary(
        requests=int(has_ft.sum()),
        without_first_token=int((~has_ft).sum()),
        derived=int(served["derived"].sum()),
        violations=int(part["violation"].notna().sum()),
        by=by_t,
        stages=stages,
        slowest=slowest,
        windows=windows,
        window_ns=int(w),
    )


_NAMES: tuple[str, ...] = (*TTFT_STAGES, *EXTRA_ROWS)
_VALUE_COLUMNS: tuple[str, ...] = (*F.STAGE_COLUMNS, "ttft_ns", "hidden_load_ns")
_TTFT_ROW = len(TTFT_STAGES)
#: `_windows`' rows of `_NAMES`: ``ttft`` then the stages.
_WINDOW_ROWS = np.array([_TTFT_ROW, *range(len(TTFT_STAGES))], dtype=np.intp)


def _quantile_indexes(m: int, qs: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy's linear method's order statistics for `qs` over `m` values: the lower and
    upper index of each quantile (-1: the maximum) and their virtual index."""
    q = np.asarray(qs, dtype=np.float64)
    virtual = (m - 1) * q
    prev = np.floor(virtual)
    nxt = prev + 1
    above = virtual >= m - 1  # past the last index: the maximum
    prev[above] = -1
    nxt[above] = -1
    return prev.astype(np.intp), nxt.astype(np.intp), virtual


def quantile_positions(m: int, qs: Sequence[float]) -> np.ndarray:
    """The positions (ascending, distinct) of a row of `m` values (at least one) that
    `sorted_quantiles` reads for `qs`: a row partitioned at them (``np.partition``, each
    holding the value a sort puts there) gives the same quantiles as the row sorted."""
    prev_i, nxt_i, _ = _quantile_indexes(m, qs)
    return np.unique(np.concatenate([prev_i, nxt_i]) % m)


def sorted_quantiles(s: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """``np.quantile(row, qs)`` of every row of `s` (at least one column; each row sorted
    ascending, or partitioned at ``quantile_positions(len(row), qs)``): numpy's linear
    method with its own arithmetic (`numpy.lib._function_base_impl`'s ``_get_indexes`` and
    ``_lerp``), so that the values are the same to the last bit while one sort (or
    partition) serves every quantile of a row. Shape ``(len(qs), rows)``."""
    m = s.shape[1]
    prev_i, nxt_i, virtual = _quantile_indexes(m, qs)
    a, b = s[:, prev_i].T, s[:, nxt_i].T
    gamma = (virtual - prev_i)[:, None]
    diff = b - a
    out = np.add(a, diff * gamma)
    np.subtract(b, diff * (1 - gamma), out=out, where=np.broadcast_to(gamma >= 0.5, out.shape),
                casting="unsafe", dtype=np.float64)
    return out


def _summarize_all(part: pd.DataFrame, has_ft: np.ndarray, window_ns: int | None,
                   origin_ns: int | None) -> TTFTSummary:
    """`summarize` without groups, in numpy: the value columns read once into one int64
    matrix (a row per name of `_NAMES`, a column per served request), one sort per row for
    every quantile, no per-row frame. The same figures as the grouped path's (the
    `_stage_table`, `_slowest` and `_windows` arithmetic)."""
    every = bool(has_ft.all())
    m = len(has_ft) if every else int(has_ft.sum())
    x = np.empty((len(_NAMES), m), dtype=np.int64)
    for i, c in enumerate(_VALUE_COLUMNS):
        v = int_column(part, c, 0)
        x[i] = v if every else v[has_ft]
    arrival = int_column(part, "arrival_ns")
    if not every:
        arrival = arrival[has_ft]
    # A copy of `x` (whose rows the shares and sums still read in request order) with each
    # row's order statistics that the quantiles read in their sorted places (`_stage_matrix`:
    # QUANTILES; the slowest requests' threshold: TTFT's p99): a partition, not a sort.
    srt = np.partition(x, quantile_positions(m, (*QUANTILES, 0.99)), axis=1) if m else x
    stages = _stage_matrix(x, srt)
    slowest = _slowest_matrix(x, srt, part, has_ft)
    w = window_ns or default_window_ns(arrival)
    origin = origin_ns if origin_ns is not None else (int(arrival.min()) if m else 0)
    windows = (_windows_matrix(x[_WINDOW_ROWS], arrival, w, origin) if m
               else pd.DataFrame(columns=_window_columns()))
    if windows is None:  # too many windows for the numpy path
        windows = _windows(_values(part.loc[has_ft]), arrival, w, origin)
    derived = column_array(part, "derived")
    if isinstance(derived, np.ndarray) and derived.dtype == np.bool_:
        n_derived = int(np.count_nonzero(derived if every else derived[has_ft]))
    else:
        n_derived = int(part.loc[has_ft, "derived"].sum())
    return TTFTSummary(
        requests=m,
        without_first_token=len(has_ft) - m,
        derived=n_derived,
        violations=int(valid_column(part, "violation").sum()),
        by=(),
        stages=stages,
        slowest=slowest,
        windows=windows,
        window_ns=int(w),
    )


def _stage_matrix(x: np.ndarray, srt: np.ndarray) -> pd.DataFrame:
    """`_stage_table_all` from the value matrix and its sorted rows."""
    names = list(_NAMES)
    n = x.shape[1]
    nan = np.full(len(names), np.nan)
    q = sorted_quantiles(srt, QUANTILES) if n else np.full((len(QUANTILES), len(names)),
                                                            np.nan)
    share = nan
    if n:
        ttft = x[_TTFT_ROW].astype(np.float64)
        inv = np.divide(1.0, ttft, out=np.full(len(ttft), np.nan), where=ttft > 0)
        if (ttft > 0).all():  # no NaN share: `np.nanmean`'s sum over its count
            share = (x * inv).sum(axis=1) / n
        elif np.isfinite(inv).any():  # a row's shares are finite exactly where inv is
            share = np.nanmean(x * inv, axis=1)
    total = x.sum(axis=1)
    ttft_total = total[_TTFT_ROW]
    return _stages_frame(names, n, q, total, share, ttft_total)


def _stages_frame(names: list[str], n: int, q: np.ndarray, total: np.ndarray, share: Any,
                  ttft_total: int) -> pd.DataFrame:
    """The whole run's stage table: per stage (`names`) its quantiles `q` (one row per
    `QUANTILES`), mean, total, mean share and share of the TTFT total, over `n` requests."""
    k = len(names)
    # The frame's blocks built here (`_table`'s values: the float ns columns rounded).
    fl = np.empty((6, k), dtype=np.float64)
    fl[:3] = q
    fl[3] = total / n if n else np.nan
    np.round(fl[:4], 3, out=fl[:4])
    fl[4] = share
    fl[5] = total / ttft_total if ttft_total > 0 else np.nan
    ints = np.empty((2, k), dtype=np.int64)
    ints[0] = n
    ints[1] = total
    return _block_frame(_STAGES_COLUMNS, [(_labels(tuple(names)).copy(), _AT0),
                                          (ints, _STAGES_INT_AT), (fl, _STAGES_FLOAT_AT)], k)


_STAGES_COLUMNS = ("stage", "requests", *_QCOLS, "mean_ns", "total_ns", "share_mean",
                   "share_of_total")
_AT0 = np.array([0], dtype=np.intp)
_STAGES_INT_AT = np.array([1, 6], dtype=np.intp)
_STAGES_FLOAT_AT = np.array([2, 3, 4, 5, 7, 8], dtype=np.intp)


def _slowest_matrix(x: np.ndarray, srt: np.ndarray, part: pd.DataFrame,
                    has_ft: np.ndarray) -> pd.DataFrame:
    """`_slowest_all` from the value matrix and its sorted rows."""
    names = list(TTFT_STAGES)
    if not x.shape[1]:
        return pd.DataFrame(columns=["stage", "threshold_ns", "requests", "mean_ns", "share"])
    ttft = x[_TTFT_ROW]
    threshold = sorted_quantiles(srt[_TTFT_ROW:_TTFT_ROW + 1], (0.99,))[0, 0]
    slow = ttft >= threshold
    count = int(slow.sum())
    sums = x[:_TTFT_ROW + 1, slow].sum(axis=1)
    tot = {x_: int(v) for x_, v in zip([*names, "ttft"], sums.tolist(), strict=True)}
    if max(abs(v) for v in tot.values()) >= 2**53:  # pandas' float sums would round
        vals = _values(part.loc[has_ft])
        return _tidy(_slowest_grouped(vals, [pd.Series("all", index=vals.index)], (), names))
    den = tot["ttft"] if tot["ttft"] > 0 else float("nan")
    return _slowest_frame(names, threshold, count, tot, den)


def _slowest_frame(names: list[str], threshold: float, count: int, tot: dict[str, int],
                   den: float) -> pd.DataFrame:
    """The whole run's slowest-requests table: the `count` requests at or over the TTFT
    `threshold`, per stage their mean and their share of those requests' TTFT (`den`)."""
    k = len(names)
    fl = np.empty((3, k), dtype=np.float64)
    fl[0] = threshold
    fl[1] = np.array([tot[x] / count for x in names], dtype=np.float64)
    np.round(fl[:2], 3, out=fl[:2])
    fl[2] = np.array([tot[x] / den for x in names], dtype=np.float64)
    ints = np.full((1, k), count, dtype=np.int64)
    return _block_frame(_SLOWEST_COLUMNS, [(_labels(tuple(names)).copy(), _AT0),
                                           (fl, _SLOWEST_FLOAT_AT), (ints, _SLOWEST_INT_AT)], k)


_SLOWEST_COLUMNS = ("stage", "threshold_ns", "requests", "mean_ns", "share")
_SLOWEST_FLOAT_AT = np.array([1, 3, 4], dtype=np.intp)
_SLOWEST_INT_AT = np.array([2], dtype=np.intp)


@cache
def _labels(values: tuple[str, ...]) -> Any:
    """The column pandas makes of a list of labels (its own inference: ``str`` or ``object``
    by version and options), made once per list; `build_frame` hands out copies."""
    return pd.Series(list(values)).array


@cache
def _column_index(names: tuple[str, ...]) -> pd.Index:
    """The columns index ``pd.DataFrame`` makes of these names, made once; handed out as
    views (a name set on one frame's columns stays there)."""
    return pd.DataFrame({c: [] for c in names}).columns


def column_array(df: pd.DataFrame, name: str) -> Any:
    """The array a column of `df` holds (a numpy array or a pandas extension array), without
    the Series ``df[name]`` builds (tens of µs a column; this is about two): for reading only,
    never write into it. Falls back to ``df[name]`` where the frame's private accessor is
    missing or the name is not one column."""
    try:
        i = df.columns.get_loc(name)
        if isinstance(i, int):
            return df._get_column_array(i)
    except (AttributeError, TypeError):
        pass
    col = df[name]
    return col.to_numpy() if isinstance(col.dtype, np.dtype) else col.array


def _is_int64_masked(a: Any) -> bool:
    """A pandas ``Int64`` array (values in ``_data``, nulls in ``_mask``)."""
    try:
        return (type(a) is _integer_array() and a._data.dtype == np.int64
                and a._mask.dtype == np.bool_ and a._data.shape == a._mask.shape)
    except AttributeError:  # a pandas whose IntegerArray keeps its parts elsewhere
        return False


@cache
def _integer_array() -> type:
    """pandas' IntegerArray type (looked up once: pandas is imported on a thread)."""
    return pd.arrays.IntegerArray


def int_column(df: pd.DataFrame, name: str, fill: int = -1) -> np.ndarray:
    """``analyzers.frames.ints(df[name], fill)`` (int64, nulls as `fill`) read through
    `column_array`: for reading only (it may be the frame's own buffer). Other dtypes than
    numpy int64 and ``Int64`` go through `F.ints` itself."""
    a = column_array(df, name)
    if isinstance(a, np.ndarray) and a.dtype == np.int64:
        return _read_only(a)
    if _is_int64_masked(a):
        data = a._data
        if not a._mask.any():
            return _read_only(data)
        data = data.copy()
        data[a._mask] = fill
        return data if data.dtype is _INT64 else data.view(_INT64)
    return F.ints(df[name], fill)


def valid_column(df: pd.DataFrame, name: str) -> np.ndarray:
    """``analyzers.frames.valid(df[name])`` (the non-null rows) read through `column_array`;
    a fresh array."""
    a = column_array(df, name)
    if isinstance(a, np.ndarray) and a.dtype.kind in "iub":
        return np.ones(len(a), dtype=bool)
    if _is_int64_masked(a):
        return ~a._mask
    if not isinstance(a, np.ndarray):
        return ~np.asarray(a.isna(), dtype=bool)
    return F.valid(df[name])


_INT64 = np.dtype(np.int64)


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only int64 view of a frame's own buffer (a write raises, as into `F.ints`'s)."""
    v = a.view(_INT64)
    v.flags.writeable = False
    return v


def build_frame(data: Mapping[str, Any], n: int) -> pd.DataFrame:
    """``pd.DataFrame(data)`` for columns that are 1-D numpy arrays or pandas extension
    arrays of length `n` (or tuples/lists of labels of length `n`), built without pandas'
    per-column inference and alignment: the same frame (columns, dtypes, values, a
    ``RangeIndex``) at a fraction of the cost (a few µs a column, not tens). numpy columns
    are copied into their blocks, as the constructor copies them; extension arrays are taken
    as they are, so pass ones that nothing else holds (copies of a caller's: cheap for
    Arrow-backed strings, whose data is never rewritten)."""
    arrays = [(_labels(tuple(v)).copy() if isinstance(v, (list, tuple)) else v)
              for v in data.values()]
    make = _from_blocks()
    if make is not None:
        blocks = _blocks(arrays, n)
        if blocks is not None:
            try:
                return make(blocks, index=pd.RangeIndex(n),
                            columns=_column_index(tuple(data)).view())
            except (TypeError, ValueError, AttributeError):  # pragma: no cover - a pandas
                pass  # whose block constructor differs: the general path below
    try:
        return pd.DataFrame._from_arrays(arrays, columns=_column_index(tuple(data)).view(),
                                         index=pd.RangeIndex(n), verify_integrity=False)
    except (AttributeError, TypeError):  # a pandas without the private constructor
        return pd.DataFrame(dict(zip(data, arrays, strict=True)), index=pd.RangeIndex(n))


@cache
def _from_blocks() -> Any:
    """pandas' ``create_dataframe_from_blocks`` (``pandas.api.internals``), None where this
    pandas lacks it."""
    try:
        from pandas.api.internals import create_dataframe_from_blocks
    except ImportError:  # pragma: no cover - an older pandas
        return None
    return create_dataframe_from_blocks


#: numpy dtype kinds `_blocks` places into blocks itself (others: the general constructor).
_BLOCK_KINDS = frozenset("iub")


def _blocks(arrays: Sequence[Any], n: int) -> list[tuple[Any, np.ndarray]] | None:
    """The blocks ``DataFrame._from_arrays`` makes of `arrays` (columns of length `n`): the
    numpy columns of one dtype stacked (copied) into one 2-D block in column order, each
    extension array a block of its own, taken as it is. None when a column is anything
    else (object, datetime, float16, another byte order, a numpy-backed extension array,
    a length other than `n`): the caller then takes pandas' general path."""
    groups: dict[np.dtype, list[int]] = {}
    out: list[tuple[Any, np.ndarray]] = []
    for i, a in enumerate(arrays):
        if isinstance(a, np.ndarray):
            dt = a.dtype
            if (a.ndim != 1 or len(a) != n or not dt.isnative
                    or not (dt.kind in _BLOCK_KINDS or dt in _FLOATS)):
                return None
            groups.setdefault(dt, []).append(i)
        elif (getattr(a, "ndim", 1) != 1 or len(a) != n
              or isinstance(a.dtype, np.dtype) or _numpy_backed(a)):
            return None
        else:
            out.append((a, np.array([i], dtype=np.intp)))
    for dt, cols in groups.items():
        vals = np.empty((len(cols), n), dtype=dt)
        for j, i in enumerate(cols):
            vals[j] = arrays[i]
        out.append((vals, np.array(cols, dtype=np.intp)))
    return out


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _numpy_backed(a: Any) -> bool:
    """An extension array that wraps a numpy array as it is (pandas' ``NumpyExtensionArray``,
    which the frame constructor unwraps)."""
    cls = getattr(pd.arrays, "NumpyExtensionArray", None) or pd.arrays.PandasArray
    return isinstance(a, cls)


def _block_frame(columns: tuple[str, ...], blocks: list[tuple[Any, np.ndarray]], n: int
                 ) -> pd.DataFrame:
    """The frame of `columns` (`n` rows, a ``RangeIndex``) made of `blocks`: ``(values,
    positions)`` pairs, values a C-contiguous 2-D numpy array (a row per column, one dtype)
    or a 1-D extension array, taken as they are (pass arrays nothing else holds). The same
    frame as `build_frame` of those columns."""
    make = _from_blocks()
    if make is not None:
        try:
            return make(blocks, index=pd.RangeIndex(n), columns=_column_index(columns).view())
        except (TypeError, ValueError, AttributeError):  # pragma: no cover - see build_frame
            pass
    cols: list[Any] = [None] * len(columns)
    for values, at in blocks:
        for j, i in enumerate(at.tolist()):
            cols[i] = values[j] if isinstance(values, np.ndarray) else values
    return build_frame(dict(zip(columns, cols, strict=True)), n)


def _table(data: dict[str, Any]) -> pd.DataFrame:
    """``_tidy(pd.DataFrame(data))`` for columns given as numpy arrays (and lists): the float
    ns arrays rounded before the one frame is built."""
    if not all(isinstance(v, np.ndarray) for k, v in data.items() if k.endswith("_ns")):
        return _tidy(pd.DataFrame(data))
    cols = {k: (v.round(3) if k.endswith("_ns") and v.dtype == np.float64 else v)
            for k, v in data.items()}
    n = next((len(v) for v in cols.values()), 0)
    if not all(len(v) == n for v in cols.values()):
        return pd.DataFrame(cols)
    return build_frame(cols, n)


def _tidy(df: pd.DataFrame) -> pd.DataFrame:
    """Round float ns columns to 1e-3 ns: interpolated percentiles carry float noise such as
    5596000.000000001 that means nothing at ns resolution."""
    cols = [c for c, t in df.dtypes.items() if c.endswith("_ns") and t == np.float64]
    if not cols:
        return df
    # One new frame rather than a column assignment each (the same values: Series.round is
    # numpy's round).
    return pd.DataFrame({c: (df[c].to_numpy().round(3) if c in cols else df[c])
                         for c in df.columns}, index=df.index)


def _stack(parts: dict[str, pd.DataFrame], by: tuple[str, ...]) -> pd.DataFrame:
    """{stat: (groups x stages)} → one row per (group, stage) with one column per stat."""
    long = pd.DataFrame({k: v.stack(future_stack=True) for k, v in parts.items()})
    long.index = long.index.set_names([*(by or ("_group",)), "stage"])
    long = long.reset_index()
    return long.drop(columns="_group") if not by else long


def _stage_table(vals: pd.DataFrame, keys: list[pd.Series], names: list[str],
                 by: tuple[str, ...]) -> pd.DataFrame:
    if not by:
        return _stage_table_all(vals, names)
    g = vals[names].groupby(keys, sort=True, observed=True)
    parts = {col: g.quantile(q) for q, col in zip(QUANTILES, _QCOLS, strict=True)}
    parts["mean_ns"] = g.mean()
    total = g.sum()
    parts["total_ns"] = total
    share = vals[[f"share:{n}" for n in names]].groupby(keys, sort=True, observed=True).mean()
    share.columns = names
    parts["share_mean"] = share
    parts["share_of_total"] = total.div(total["ttft"].where(total["ttft"] > 0), axis=0)
    out = _stack(parts, by)
    counts = g.size()
    out.insert(len(by) + 1, "requests",
               np.repeat(counts.to_numpy(dtype=np.int64), len(names)))
    out["total_ns"] = out["total_ns"].astype(np.int64)
    return _tidy(out)


def _stage_table_all(vals: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """`_stage_table` for the whole run: numpy's selection-based quantiles, no groupby sort."""
    n = len(vals)
    cols = [vals[x].to_numpy() for x in names]
    nan = np.full(len(names), np.nan)
    q = np.array([np.quantile(c, QUANTILES) for c in cols]).T if n else \
        np.full((len(QUANTILES), len(names)), np.nan)
    with np.errstate(invalid="ignore"):
        share = np.array([np.nanmean(vals[f"share:{x}"].to_numpy())
                          if np.isfinite(vals[f"share:{x}"].to_numpy()).any() else np.nan
                          for x in names]) if n else nan
    total = np.array([int(c.sum()) for c in cols], dtype=np.int64)
    ttft_total = total[names.index("ttft")]
    return _stages_frame(names, n, q, total, share, ttft_total)


def _slowest(vals: pd.DataFrame, keys: list[pd.Series], by: tuple[str, ...]) -> pd.DataFrame:
    names = list(TTFT_STAGES)
    cols = [*by, "stage", "threshold_ns", "requests", "mean_ns", "share"]
    if not len(vals):
        return pd.DataFrame(columns=cols)
    if not by:
        return _slowest_all(vals, names)
    return _tidy(_slowest_grouped(vals, keys, by, names))


def _slowest_all(vals: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """`_slowest` for the whole run, in numpy: the same figures (means of int64 columns are
    their exact sums over the count, as pandas' are while the sums stay below 2**53)."""
    ttft = vals["ttft"].to_numpy()
    threshold = np.quantile(ttft, 0.99)
    slow = ttft >= threshold
    count = int(slow.sum())
    tot = {x: int(vals[x].to_numpy()[slow].sum()) for x in [*names, "ttft"]}
    if max(abs(v) for v in tot.values()) >= 2**53:  # pandas' float sums would round
        return _tidy(_slowest_grouped(vals, [pd.Series("all", index=vals.index)], (), names))
    den = tot["ttft"] if tot["ttft"] > 0 else float("nan")
    return _slowest_frame(names, threshold, count, tot, den)


def _slowest_grouped(vals: pd.DataFrame, keys: list[pd.Series], by: tuple[str, ...],
                     names: list[str]) -> pd.DataFrame:
    cols = [*by, "stage", "threshold_ns", "requests", "mean_ns", "share"]
    ttft = vals["ttft"]
    if by:
        thr_by_group = ttft.groupby(keys, sort=True, observed=True).quantile(0.99)
        key_frame = pd.DataFrame({f"k{i}": k for i, k in enumerate(keys)})
        where = pd.MultiIndex.from_frame(key_frame) if len(keys) > 1 else pd.Index(keys[0])
        threshold = thr_by_group.reindex(where).to_numpy()
    else:
        threshold = np.quantile(ttft.to_numpy(), 0.99)
        thr_by_group = pd.Series([threshold], index=pd.Index(["all"]))
    slow = ttft.to_numpy() >= threshold
    sv = vals.loc[slow, [*names, "ttft"]]
    g = sv.groupby([k.loc[slow] for k in keys], sort=True, observed=True)
    tot = g.sum()
    parts = {
        "mean_ns": g.mean()[names],
        "share": tot[names].div(tot["ttft"].where(tot["ttft"] > 0), axis=0),
    }
    out = _stack(parts, by)
    counts = g.size()
    out.insert(len(by) + 1, "threshold_ns",
               np.repeat(thr_by_group.reindex(counts.index).to_numpy(), len(names)))
    out.insert(len(by) + 2, "requests", np.repeat(counts.to_numpy(dtype=np.int64), len(names)))
    return out[cols]


#: Windows up to which `_windows` takes each window's quantiles in numpy (more: pandas).
_NUMPY_WINDOWS = 256


def _group_quantiles(v: np.ndarray) -> list[float]:
    """pandas' groupby quantile of one group (linear interpolation, its own arithmetic:
    ``x[j] + (x[j + 1] - x[j]) * frac`` with ``frac = (q * (n - 1)) % 1``), at `QUANTILES`."""
    x = np.sort(v.astype(np.float64))
    m = len(x)
    out = []
    for q in QUANTILES:
        h = q * float(m - 1)
        j = int(h)
        frac = h % 1
        out.append(float(x[j]) if frac == 0.0 else float(x[j] + (x[j + 1] - x[j]) * frac))
    return out


def _window_columns() -> list[str]:
    return list(_WINDOW_COLUMNS)


_WINDOW_COLUMNS: tuple[str, ...] = ("window_start_ns", "window_start_s", "requests",
                                    *(f"{n}_{q}" for n in ["ttft", *TTFT_STAGES]
                                      for q in _QCOLS))
#: The windows frame's int64 and float64 columns (positions in `_WINDOW_COLUMNS`).
_WIN_INT_AT = np.array([0, 2], dtype=np.intp)
_WIN_FLOAT_AT = np.array([1, *range(3, len(_WINDOW_COLUMNS))], dtype=np.intp)


def _windows(vals: pd.DataFrame, arrival: np.ndarray, window_ns: int, origin_ns: int
             ) -> pd.DataFrame:
    names = ["ttft", *TTFT_STAGES]
    cols = _window_columns()
    if not len(vals):
        return pd.DataFrame(columns=cols)
    if _NUMPY_WINDOWS > 0:
        out = _windows_matrix(np.stack([F.ints(vals[n], 0) for n in names]), arrival,
                              window_ns, origin_ns)
        if out is not None:
            return out
    start = origin_ns + ((arrival - origin_ns) // window_ns) * window_ns
    g = vals[names].groupby(start, sort=True)
    qv = g.quantile(list(QUANTILES))  # one sort per column for all three quantiles
    out = pd.DataFrame({"requests": g.size()})
    for q, qc in zip(QUANTILES, _QCOLS, strict=True):
        at = qv.xs(q, level=-1)
        for n in names:
            out[f"{n}_{qc}"] = at[n]
    out = out.reset_index(names="window_start_ns")
    out["window_start_s"] = (out["window_start_ns"] - origin_ns) / 1e9
    return _tidy(out.reindex(columns=cols))


def _windows_matrix(y: np.ndarray, arrival: np.ndarray, window_ns: int, origin_ns: int
                    ) -> pd.DataFrame | None:
    """`_windows`' numpy path: `y` holds a row per window column (``ttft`` then the stages,
    int64), a column per request (at least one). None when there are more than
    `_NUMPY_WINDOWS` windows (the pandas path then)."""
    names = ["ttft", *TTFT_STAGES]
    start = origin_ns + ((arrival - origin_ns) // window_ns) * window_ns
    in_order = bool((start[1:] >= start[:-1]).all())
    if in_order:  # arrivals in order (a run's are): runs of equal starts, no sort
        change = np.empty(len(start), dtype=bool)
        change[0] = True
        np.not_equal(start[1:], start[:-1], out=change[1:])
        first = np.flatnonzero(change)
        starts = start.take(first)
        counts = np.diff(first, append=len(start))
    else:
        starts, counts = np.unique(start, return_counts=True)
    if len(starts) > _NUMPY_WINDOWS:
        return None
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    nw = len(starts)
    # Each row in window order, each window's run partitioned in place (as int64: the float64
    # conversion is monotonic, so the order statistics are the same values); every window's
    # quantiles then picked at once, with `_group_quantiles`' arithmetic.
    x = y if in_order else y[:, np.argsort(start, kind="stable")]
    m1 = (counts - 1).astype(np.float64)
    h = np.multiply.outer(np.asarray(QUANTILES, dtype=np.float64), m1)  # (quantile, window)
    j = h.astype(np.int64)  # int(h): h >= 0
    j1 = np.minimum(j + 1, counts - 1)
    # Only the order statistics read below need their sorted place: each window's run
    # partitioned at them (the same values there as a sort puts).
    kth = np.concatenate([j, j1]).T.tolist()  # per window
    for i in range(nw):
        x[:, bounds[i]:bounds[i + 1]].partition(kth[i], axis=1)
    frac = h % 1
    at = bounds[:-1]
    lo = x[:, at + j].astype(np.float64)  # (name, quantile, window)
    hi = x[:, at + j1].astype(np.float64)
    v = np.where(frac == 0.0, lo, lo + (hi - lo) * frac)
    # One float block: window_start_s, then a row per (name, quantile) in column order,
    # rounded as `_table` rounds each ns column; one int64 block: window_start_ns, requests.
    fl = np.empty((1 + len(names) * len(QUANTILES), nw), dtype=np.float64)
    fl[0] = (starts - origin_ns) / 1e9
    np.round(v.reshape(len(names) * len(QUANTILES), nw), 3, out=fl[1:])
    ints = np.empty((2, nw), dtype=np.int64)
    ints[0] = starts
    ints[1] = counts
    return _block_frame(_WINDOW_COLUMNS, [(ints, _WIN_INT_AT), (fl, _WIN_FLOAT_AT)], nw)
