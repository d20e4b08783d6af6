"""What every importer returns (`ImportedRun`) and the helpers they share.

An importer turns another tool's output into the run-store frames (`requests`, `spans`; schemas in
agent/schema.py) and says, in plain sentences, what it could and could not derive from it. Nothing
here guesses: a quantity the source does not carry stays null (pandas `<NA>`) and is listed in
`cannot`.

An importer may hand `ImportedRun` its frames as Arrow tables (`requests_table`, `spans_table`,
`concat_span_tables`): they are turned into the DataFrames the attributes give when first read, so
that an import whose caller never reads them never loads pandas (the largest import of a small
trace's whole process). The tables are built from buffers: `pa.array` probes its input with
pandas' type checks, which import pandas.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from agent.errors import InputError
from agent.intervals import priority_spans
from agent.schema import (
    REQUESTS_SCHEMA,
    SPANS_SCHEMA,
    STAGE_PRIORITY,
    TTFT_STAGES,
)
from analyzers.units import fmt_ns

if TYPE_CHECKING:
    import pandas as pd

try:  # orjson parses Kineto traces ~3x faster than json; it is optional
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

GZIP_MAGIC = b"\x1f\x8b"
INT64_MAX = (1 << 63) - 1
#: the largest time (epoch ns, or ns since a session start) an import accepts: year 2262 is
#: where int64 ns end; anything near it is a corrupt field, not a time
TIME_NS_MAX = 1 << 62


class _Frame:
    """`ImportedRun.requests` / `.spans`: holds an Arrow table or a DataFrame; reading it gives
    the DataFrame (an Arrow table is converted on the first read, then kept)."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.name = table

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> pd.DataFrame:
        if obj is None:  # no class-level default: the dataclass field stays required
            raise AttributeError(self.name)
        v = obj.__dict__[self.name]
        if isinstance(v, pa.Table):
            v = obj.__dict__[self.name] = frame_of(self.table, v)
        return v

    def __set__(self, obj: Any, value: pd.DataFrame | pa.Table) -> None:
        obj.__dict__[self.name] = value


def frame_of(table: str, tbl: pa.Table) -> pd.DataFrame:
    """An import's ``requests`` or ``spans`` Arrow table as the DataFrame `ImportedRun` gives
    (what `requests_frame` / `spans_frame` return for the same columns)."""
    import pandas as pd

    if table == "requests":
        return tbl.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    if tbl.schema.names != SPANS_SCHEMA.names or any(tbl[c].null_count for c in _PLAIN_INTS):
        from agent.runstore.reader import to_pandas  # (and pyarrow.parquet) only here

        return to_pandas(tbl, SPANS_SCHEMA)
    # What `to_pandas` gives, in one conversion (and without the reader's imports): every
    # integer column as a nullable one, then the non-nullable ones as numpy int64 again.
    df = tbl.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype(),
                                     pa.int32(): pd.Int32Dtype()}.get)
    for c in _PLAIN_INTS:
        df[c] = np.array(tbl[c].to_numpy())  # a copy: writable, as to_pandas' columns are
    return df


#: SPANS_SCHEMA's non-nullable integer columns (numpy integers in the frame, not Int64)
_PLAIN_INTS = [f.name for f in SPANS_SCHEMA if not f.nullable and pa.types.is_integer(f.type)]


@dataclass
class ImportedRun:
    """Another tool's output mapped onto kvscope's frames.

    Attributes:
        source: which format and flavour was read, e.g. ``vllm-prometheus-v1``, ``kineto``.
        path: the file read.
        requests: one row per request, REQUESTS_SCHEMA columns. Integer columns are pandas
            ``Int64``; accounting columns the source does not carry are ``<NA>`` (unknown), not 0.
        spans: SPANS_SCHEMA columns. State spans of a request partition its TTFT exactly; the
            part no source field explains is an explicit ``other`` span. An importer may set
            either frame to an Arrow table of the same columns (`requests_table`,
            `spans_table`): it becomes the DataFrame when first read (`rows` counts it as is).
        distributions: aggregate-only sources (Prometheus): one row per histogram series with
            ``metric, labels, stage, unit, count, sum, sum_s, mean, p50, p90, p99, buckets,
            complete, note``; None for per-request sources.
        ratios: each ``{name, numerator, denominator, denominator_unit, source_metric, value,
            note}``, labelled with the *source's* denominator (None when the source only has a
            precomputed ratio).
        summary: source-specific totals (kernel counts and time, copies by direction, gauges).
        derived / can / cannot: human-readable sentences on what was derived (and how), what
            the import supports and what it cannot tell.
        partition_derived: True when state spans were reconstructed (a sweep line over
            overlapping ranges, or durations laid end to end) rather than recorded as a partition.
    """

    source: str
    path: Path
    requests: pd.DataFrame = _Frame("requests")  # type: ignore[assignment]
    spans: pd.DataFrame = _Frame("spans")  # type: ignore[assignment]
    distributions: pd.DataFrame | None = None
    ratios: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    derived: list[str] = field(default_factory=list)
    can: list[str] = field(default_factory=list)
    cannot: list[str] = field(default_factory=list)
    partition_derived: bool = False

    @classmethod
    def empty(cls, source: str, path: Path) -> ImportedRun:
        """A run with empty requests and spans frames (importers fill them in)."""
        return cls(source=source, path=path, requests=requests_table({}, 0),
                   spans=spans_table({}, 0))

    def rows(self, table: str) -> int:
        """Rows of ``requests`` or ``spans``, without building a DataFrame for it."""
        v = self.__dict__[table]
        return v.num_rows if isinstance(v, pa.Table) else len(v)

    def as_store(self) -> SimpleNamespace:
        """The import shaped like an `agent.runstore.RunStore` (requests, spans, empty layers,
        samples and events, `meta`, `gaps`, `path`), so run-store analyses accept it."""
        from agent.runstore.reader import to_pandas
        from agent.schema import TABLES

        def empty(name: str) -> pd.DataFrame:
            return to_pandas(TABLES[name].empty_table(), TABLES[name])

        meta = {"run_id": None, "status": f"imported from {self.source}",
                "config": {}, "source": self.source}
        return SimpleNamespace(requests=self.requests, spans=self.spans, layers=empty("layers"),
                               samples=empty("samples"), events=empty("events"), meta=meta,
                               gaps=[], path=self.path)

    def to_dict(self) -> dict[str, Any]:
        """What `kvscope analyze --json` can print: everything but the per-row frames.

        Returns:
            A JSON-serialisable dict (NaN and <NA> become None).
        """
        dist = None
        if self.distributions is not None:
            d = self.distributions.astype(object)
            dist = d.where(d.notna(), None).to_dict(orient="records")
        return {
            "source": self.source, "path": str(self.path), "requests": self.rows("requests"),
            "spans": self.rows("spans"), "partition_derived": self.partition_derived,
            "derived": list(self.derived), "can": list(self.can), "cannot": list(self.cannot),
            "ratios": [dict(r) for r in self.ratios], "summary": self.summary,
            "distributions": dist,
        }


# --------------------------------------------------------------------------------------------
# Reading files
# --------------------------------------------------------------------------------------------


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when it is gzip. Truncated or corrupt gzip → InputError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a file to import") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except EOFError:
            raise InputError(f"{path}: truncated gzip (stream ends early)") from None
        except (OSError, zlib.error) as exc:
            raise InputError(f"{path}: corrupt gzip ({exc})") from None
    return data


def parse_json(data: bytes, path: Path) -> Any:
    """Parse JSON bytes (orjson when installed). Cut or invalid JSON → InputError."""
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark: not part of the JSON
        data = data[3:]
    try:
        if _orjson is not None:
            return _orjson.loads(data)
        return json.loads(data)
    except RecursionError:  # the standard library's parser on deeply nested arrays/objects
        raise InputError(f"{path}: invalid JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        # orjson.JSONDecodeError and json.JSONDecodeError are both ValueErrors
        what = "truncated JSON" if _looks_cut(data) else "invalid JSON"
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: {what} ({msg})") from None


def _looks_cut(data: bytes) -> bool:
    tail = data.rstrip()[-1:]
    return tail not in (b"}", b"]")


# --------------------------------------------------------------------------------------------
# Reading fields: every per-field problem becomes "<file>: <record>: <field>: what is wrong"
# --------------------------------------------------------------------------------------------


def field_error(path: Path | str, record: str, name: str, what: str) -> InputError:
    """The one-line error for a bad field: ``<file>: <record>: <field>: <what is wrong>``."""
    return InputError(f"{path}: {record}: {name}: {what}")


def shown(v: Any) -> str:
    """A value as an error message shows it: its JSON type and (short) content."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return f"an object ({len(v)} key{'s' if len(v) != 1 else ''})"
    if isinstance(v, list | tuple):
        return f"a list ({len(v)} item{'s' if len(v) != 1 else ''})"
    if isinstance(v, bytes):
        return f"{len(v)} bytes of binary data"
    text = repr(v)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"a string {text}" if isinstance(v, str) else text


def is_number(v: Any) -> bool:
    """A JSON number (int or float, not a bool)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def number_field(v: Any, path: Path | str, record: str, name: str, *, lo: float | None = None,
                 hi: float | None = None) -> float:
    """A finite JSON number in [lo, hi]; anything else is a `field_error`."""
    if not is_number(v):
        raise field_error(path, record, name, f"expected a number, got {shown(v)}")
    try:
        f = float(v)
    except OverflowError:  # an int beyond float range
        raise field_error(path, record, name, f"{v} is out of range") from None
    if not math.isfinite(f):
        raise field_error(path, record, name, f"expected a finite number, got {shown(v)}")
    if lo is not None and f < lo:
        raise field_error(path, record, name, f"{v:g} is below {lo:g}")
    if hi is not None and f > hi:
        raise field_error(path, record, name, f"{v:g} is out of range (at most {hi:g})")
    return f


def count_field(v: Any, path: Path | str, record: str, name: str,
                hi: int = INT64_MAX) -> int:
    """A non-negative integer (an integral float such as ``4096.0`` too) up to `hi`."""
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    elif isinstance(v, float) and math.isfinite(v) and v.is_integer():
        n = int(v)
    else:
        raise field_error(path, record, name, f"expected an integer, got {shown(v)}")
    if n < 0:
        raise field_error(path, record, name, f"{n} is negative")
    if n > hi:
        raise field_error(path, record, name, f"{n} is out of range (at most {hi})")
    return n


def int_field(v: Any, path: Path | str, record: str, name: str, *, lo: int = -INT64_MAX,
              hi: int = INT64_MAX, strings: bool = False) -> int:
    """An integer in [lo, hi]; with `strings`, a decimal string too (proto3 JSON's int64)."""
    what = "an integer or a decimal string" if strings else "an integer"
    if isinstance(v, str) and strings:
        t = v.strip()
        if not (t.lstrip("+-").isdigit() and t.isascii()) or len(t) > 24:
            raise field_error(path, record, name, f"expected {what}, got {shown(v)}")
        n = int(t)
    elif isinstance(v, int) and not isinstance(v, bool):
        n = v
    else:
        raise field_error(path, record, name, f"expected {what}, got {shown(v)}")
    if not lo <= n <= hi:
        raise field_error(path, record, name, f"{n} is out of range ({lo} .. {hi})")
    return n


# --------------------------------------------------------------------------------------------
# Building frames
# --------------------------------------------------------------------------------------------


def requests_table(cols: dict[str, Any], n: int) -> pa.Table:
    """The requests Arrow table `requests_frame` converts (every REQUESTS_SCHEMA column, all
    nullable: accounting columns are non-null in the run store, imports may not know them)."""
    arrays = [_array(cols.get(f.name), f.type, n) for f in REQUESTS_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=_IMPORT_REQUESTS_SCHEMA)


def requests_frame(cols: dict[str, Any], n: int) -> pd.DataFrame:
    """A requests DataFrame with every REQUESTS_SCHEMA column.

    Args:
        cols: column name → sequence of length `n`; absent columns are null (accounting columns
            too: an importer that does not know a count leaves it unknown).
        n: number of rows.
    Returns:
        The frame, integer columns as ``Int64``.
    """
    return frame_of("requests", requests_table(cols, n))


def spans_table(cols: dict[str, Any], n: int) -> pa.Table:
    """The spans Arrow table `spans_frame` converts (every SPANS_SCHEMA column)."""
    arrays = [_array(cols.get(f.name), f.type, n) for f in SPANS_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=SPANS_SCHEMA)


def spans_frame(cols: dict[str, Any], n: int) -> pd.DataFrame:
    """A spans DataFrame with every SPANS_SCHEMA column (absent columns null).

    Args:
        cols: column name → sequence of length `n`.
        n: number of rows.
    Returns:
        The frame, nullable integer columns as ``Int64``/``Int32``.
    """
    return frame_of("spans", spans_table(cols, n))


@functools.cache
def _empty(table: str) -> pd.DataFrame:
    return requests_frame({}, 0) if table == "requests" else spans_frame({}, 0)


def concat_spans(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate span frames, keeping the schema (an empty list gives an empty frame)."""
    import pandas as pd

    frames = [f for f in frames if len(f)]
    if not frames:
        return _empty("spans").copy()
    return pd.concat(frames, ignore_index=True)


def concat_span_tables(tables: list[pa.Table]) -> pa.Table:
    """`concat_spans` for Arrow span tables: the same rows, in order, as one table (converted,
    it is the frame `concat_spans` gives for the tables' frames)."""
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return spans_table({}, 0)
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


_IMPORT_REQUESTS_SCHEMA = pa.schema([pa.field(f.name, f.type, nullable=True)
                                     for f in REQUESTS_SCHEMA])


def _array(values: Any, typ: pa.DataType, n: int) -> pa.Array:
    if values is None:
        return pa.nulls(n, type=typ)
    if isinstance(values, pa.Array | pa.ChunkedArray):
        return values.cast(typ)
    built = _from_buffers(values, typ, n)
    if built is not None:
        return built
    if isinstance(values, np.ndarray) and values.dtype.kind in "iuf" and pa.types.is_integer(typ):
        return pa.array(values.astype(np.int64, copy=False)).cast(typ)
    return pa.array(values, type=typ, from_pandas=True)


_INT_TYPES = {pa.int64(): np.int64, pa.int32(): np.int32}


def _from_buffers(values: Any, typ: pa.DataType, n: int) -> pa.Array | None:
    """`_array`'s result built from buffers, without `pa.array` (which imports pandas): for
    int64/int32 from a numeric numpy array or a sequence of Python ints and None, and for
    strings from a sequence of str and None. None for anything else (or a value that does not
    fit): `pa.array` then builds it, or refuses it, as it always has."""
    np_type = _INT_TYPES.get(typ)
    if np_type is None and typ != pa.string():
        return None
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or len(values) != n:
            return None
        if values.dtype.kind in "iuf":
            return None if np_type is None else _fixed(typ, values.astype(np.int64), None)
        if values.dtype.kind != "O":
            return None
    elif not isinstance(values, list | tuple) or len(values) != n:
        return None
    valid = np.fromiter(map(_not_none, values), dtype=bool, count=n)
    present = [v for v in values if v is not None] if not valid.all() else values
    if np_type is not None:
        if not all(type(v) is int for v in present):
            return None  # bools, floats, numpy scalars, ...: pa.array's own conversion
        data = np.zeros(n, dtype=np.int64)
        try:
            data[valid] = np.fromiter(present, dtype=np.int64, count=len(present))
        except OverflowError:
            return None
        return _fixed(typ, data, valid)
    if not all(type(v) is str for v in present):
        return None
    try:
        enc = [v.encode("utf-8") for v in present]
    except UnicodeEncodeError:  # a lone surrogate: pa.array says what it says of it
        return None
    lengths = np.zeros(n, dtype=np.int64)
    lengths[valid] = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        return None
    bitmap, nulls = _bitmap(valid)
    return pa.Array.from_buffers(pa.string(), n, [bitmap, pa.py_buffer(offsets.astype(np.int32)),
                                                  pa.py_buffer(b"".join(enc))], null_count=nulls)


def _not_none(v: Any) -> bool:
    return v is not None


def _bitmap(valid: np.ndarray | None) -> tuple[pa.Buffer | None, int]:
    if valid is None or valid.all():
        return None, 0
    return pa.py_buffer(np.packbits(valid, bitorder="little")), int(len(valid) - valid.sum())


def _fixed(typ: pa.DataType, data: np.ndarray, valid: np.ndarray | None) -> pa.Array | None:
    """int64 `data` as an Arrow array of `typ` (int64 or int32), nulls where not `valid`; None
    when a value does not fit `typ` (the caller's `pa.array` then refuses it, as before)."""
    np_type = _INT_TYPES[typ]
    if np_type is not np.int64:
        info = np.iinfo(np_type)
        kept = data if valid is None else data[valid]
        if len(kept) and (kept.min() < info.min or kept.max() > info.max):
            return None
        data = data.astype(np_type)
    bitmap, nulls = _bitmap(valid)
    return pa.Array.from_buffers(typ, len(data), [bitmap, pa.py_buffer(
        np.ascontiguousarray(data))], null_count=nulls)


# --------------------------------------------------------------------------------------------
# The partition of TTFT from overlapping ranges
# --------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Partition:
    """State spans that partition each request's [arrival, first_token] exactly."""

    req: np.ndarray  # request index per span
    stage: np.ndarray  # stage name per span (object array)
    start_ns: np.ndarray
    end_ns: np.ndarray
    overlap_ns: int  # time where more than one stage range was open (resolved by priority)
    other_ns: int  # time no range covered (reported as `other`)


_STAGE_INDEX = {s: i for i, s in enumerate(TTFT_STAGES)}


def sweep_partition(
    req: np.ndarray,
    stage: np.ndarray,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    arrival_ns: np.ndarray,
    first_ns: np.ndarray,
) -> Partition:
    """Partition each request's TTFT from possibly overlapping, possibly gappy stage ranges
    (`agent.intervals.priority_spans`: the sweep-line priority; uncovered time is `other`).

    Args:
        req: request index of each range (into `arrival_ns`/`first_ns`).
        stage: TTFT stage name of each range.
        start_ns, end_ns: the ranges (clipped to the request's window).
        arrival_ns, first_ns: each request's window; requests with first <= arrival get no spans.
    Returns:
        The partition, sorted by request then time.
    """
    codes = np.array([_STAGE_INDEX[x] for x in np.asarray(stage, dtype=object)], dtype=np.int64)
    g, st, s, e, overlap, other = priority_spans(req, codes, start_ns, end_ns, arrival_ns,
                                                 first_ns)
    names = np.asarray(TTFT_STAGES, dtype=object)[st]
    return Partition(req=g, stage=names, start_ns=s, end_ns=e, overlap_ns=overlap,
                     other_ns=other)


def requests_from_stage_ranges(run: ImportedRun, req: np.ndarray, stage: np.ndarray,
                               start_ns: np.ndarray, end_ns: np.ndarray, ids: np.ndarray,
                               nums: np.ndarray, what: str) -> pd.DataFrame:
    """`stage_range_tables`, its spans as a DataFrame."""
    return frame_of("spans", stage_range_tables(run, req, stage, start_ns, end_ns, ids, nums,
                                                what))


def stage_range_tables(run: ImportedRun, req: np.ndarray, stage: np.ndarray,
                       start_ns: np.ndarray, end_ns: np.ndarray, ids: np.ndarray,
                       nums: np.ndarray, what: str) -> pa.Table:
    """Stage ranges of profiled requests (kvscope NVTX or `kvscope.<stage>` annotations) →
    `run.requests` and the requests' state spans.

    TTFT ranges are partitioned per request by the sweep line (they may overlap or leave holes:
    `other`); arrival and first token are the hull of a request's TTFT ranges; `decode` ranges
    are kept as they are and extend `finish_ns`.

    Args:
        run: the import; its `requests`, `partition_derived`, `derived` and `can` are set.
        req: each range's request index into `ids`/`nums`.
        stage, start_ns, end_ns: the ranges (epoch ns).
        ids, nums: per request, its id and `request_num`.
        what: how the ranges are described in the `derived` note.
    Returns:
        The state spans, as an Arrow table (`run.requests` is set to one too).
    """
    n_req = len(ids)
    arrival, first = ttft_window(req, stage, start_ns, end_ns, n_req)
    ttft_m = np.isin(stage, np.array(TTFT_STAGES, dtype=object))
    part = sweep_partition(req[ttft_m], stage[ttft_m], start_ns[ttft_m], end_ns[ttft_m],
                           arrival, first)
    dec = np.flatnonzero(~ttft_m)
    finish = first.copy()
    np.maximum.at(finish, req[dec], end_ns[dec])
    has = first > arrival
    run.requests = requests_table({
        "request_id": ids, "request_num": nums, "arrival_ns": arrival,
        "first_token_ns": [int(f) if h else None for f, h in zip(first, has, strict=True)],
        "finish_ns": finish, "status": ["ok"] * n_req}, n_req)
    run.partition_derived = True
    run.derived.append(
        f"TTFT partition of {n_req} request(s) from {len(stage)} {what} by sweep line "
        f"(priority {' > '.join(STAGE_PRIORITY[:-1])}); {fmt_ns(part.overlap_ns)} of overlap "
        f"resolved, {fmt_ns(part.other_ns)} uncovered → other; arrival/first token = hull of "
        "the request's stage ranges")
    run.can.append(f"TTFT stages for {n_req} request(s)")
    rows = np.r_[part.req, req[dec]]
    n = len(rows)
    return spans_table({
        "request_id": ids[rows], "request_num": nums[rows], "kind": ["state"] * n,
        "name": np.r_[part.stage, stage[dec]], "start_ns": np.r_[part.start_ns, start_ns[dec]],
        "end_ns": np.r_[part.end_ns, end_ns[dec]], "clock": ["cpu"] * n}, n)


def ttft_window(req: np.ndarray, stage: np.ndarray, start_ns: np.ndarray, end_ns: np.ndarray,
                n_req: int) -> tuple[np.ndarray, np.ndarray]:
    """Each request's [arrival, first_token] as the hull of its TTFT-stage ranges.

    Args:
        req, stage, start_ns, end_ns: the ranges.
        n_req: number of requests.
    Returns:
        (arrival_ns, first_ns); a request with no TTFT range gets arrival = first = 0.
    """
    is_ttft = np.isin(np.asarray(stage, dtype=object), np.asarray(TTFT_STAGES, dtype=object))
    arrival = np.full(n_req, np.iinfo(np.int64).max, dtype=np.int64)
    first = np.full(n_req, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(arrival, req[is_ttft], start_ns[is_ttft])
    np.maximum.at(first, req[is_ttft], end_ns[is_ttft])
    none = first < arrival
    arrival[none] = 0
    first[none] = 0
    return arrival, first


def us_to_ns(us: np.ndarray) -> np.ndarray:
    """Microseconds (float, ns precision) → int64 ns without float rounding at epoch scale.

    `ts * 1000` in float64 loses ~256 ns at epoch magnitudes; splitting whole and fractional
    microseconds keeps the nanoseconds the trace wrote.
    """
    us = np.asarray(us, dtype=np.float64)
    whole = np.floor(us)
    frac = np.rint((us - whole) * 1000.0).astype(np.int64)
    return whole.astype(np.int64) * 1000 + frac
