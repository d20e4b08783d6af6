"""PyTorch profiler (Kineto) Chrome-trace JSON, `.json` or `.json.gz` → stages, H2D copies, totals.

- `user_annotation` ranges named ``kvscope.<stage>#<request_num>`` (what `kvscope run --profile`
  emits, see `agent.telemetry.annotate.TorchProfilerAnnotator`) become state spans of that
  request; ``kvscope.<phase>#<step_id>`` for a step phase becomes a step span with its step id.
  The suffix is ``#`` and a decimal integer, and optional: for a bare ``kvscope.<stage>`` the
  request comes from the event's args (``request_num``/``request_id``, or a numeric first
  ``Concrete Inputs``) when the trace carries it; otherwise all such ranges belong to one
  synthetic request ``kineto-0``.
- Request ids: a trace in a run directory (`kvscope run --profile` writes
  ``<run>/profile/torch_trace.json``; ``run.json`` in the trace's folder or the one above)
  maps request_num → request_id through that run store's requests; elsewhere the id is the
  request_num as a string.
- `gpu_memcpy` events named ``Memcpy HtoD …`` become activity spans ``h2d`` with their bytes.
- Kernels, runtime calls, syncs, memsets, copies by direction (with and without a ``bytes``
  argument, counted apart) and flows are summarised, not imported row by row.
- Categories are matched case-insensitively and by older libkineto's names (``Kernel``,
  ``Memcpy``, ``Memset``, ``Runtime``, ``Operator``): see `CATEGORIES`.
- Every field read is checked first: an event that is not an object, a ph/cat/name that is not
  a string, args that are not an object, a ts/dur that is not a finite number within int64 ns
  is an InputError ``<file>: traceEvents[<i>]: <field>: ...``, never a traceback or a 0.

Times: ``ts``/``dur`` are µs floats; epoch ns = ``baseTimeNanoseconds`` + ts·1000 when the trace
has a base, else ts is already epoch µs. Parsing is the cost that matters: with msgspec installed
(the ``analysis`` extra) a typed decode reads only the fields used — ``ph, cat, name, ts, dur,
id`` and the few ``args`` that copies and annotations need, kept as raw JSON until then — and
checks them in bulk; a trace that decode refuses (bad JSON, a field of another type, a number out
of range, a ``ph`` that is none of the format's phases) is read again by the general path
(orjson, or the standard library), which names the first field at fault exactly as before.
Either way the result is the same `_Events`, vectorised from there (the typed path reads each
field it needs once per event, names only where read).
The file is read on a thread while this one reads the run store's requests (the read waits and
copies without the GIL). The spans and requests are built as Arrow tables, which `ImportedRun`
turns into its DataFrames when they are first read: an import whose caller reads none never
loads pandas (the largest import of a small trace's process).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import pyarrow as pa

try:  # the typed decode (the `analysis` extra); without it the general path reads every trace
    import msgspec
except ImportError:  # pragma: no cover - exercised where msgspec is absent
    msgspec = None  # type: ignore[assignment]

from agent.errors import InputError
from agent.schema import STATES, STEP_PHASES
from analyzers.importers.base import (
    INT64_MAX,
    TIME_NS_MAX,
    ImportedRun,
    concat_span_tables,
    count_field,
    field_error,
    is_number,
    number_field,
    parse_json,
    read_bytes,
    shown,
    spans_table,
    stage_range_tables,
    us_to_ns,
)
from analyzers.units import fmt_ns

PREFIX = "kvscope."
_T = TypeVar("_T")
#: traces older than this many µs since the epoch cannot be epoch timestamps (1 day after 1970)
_EPOCH_FLOOR_US = 86_400 * 1_000_000
_REQ_KEYS = ("request_num", "request_id", "kvscope.request_num")
#: a ts or dur (µs) beyond this cannot become int64 ns: 2**62 ns
_US_MAX = float(TIME_NS_MAX // 1000)
#: lower-cased `cat` → the category it is read as. PyTorch profiler traces (libkineto's
#: ActivityType names) write ``kernel``, ``gpu_memcpy``, ``gpu_memset``, ``cuda_runtime``,
#: ``cuda_sync``, ``cpu_op``, ``user_annotation`` (the files in shared/data/kineto); older
#: libkineto (its first output_json.cpp) wrote ``Kernel``, ``Memcpy``, ``Memset``, ``Runtime``
#: and ``Operator``.
CATEGORIES = {
    "kernel": "kernel", "gpu_memcpy": "gpu_memcpy", "memcpy": "gpu_memcpy",
    "gpu_memset": "gpu_memset", "memset": "gpu_memset", "cuda_runtime": "cuda_runtime",
    "runtime": "cuda_runtime", "cuda_sync": "cuda_sync", "cpu_op": "cpu_op",
    "operator": "cpu_op", "user_annotation": "user_annotation",
}
#: the category read → its code in `_Events.cats` (0: a category the importer does not read)
_CAT_CODE = {c: i + 1 for i, c in enumerate(sorted(set(CATEGORIES.values())))}


@dataclass(slots=True)
class KinetoTrace:
    """A Kineto / Chrome trace as read from disk.

    Attributes:
        events: the `traceEvents` list, as parsed.
        base_ns: `baseTimeNanoseconds` when the trace has one (an event's epoch ns is then
            `base_ns + ts * 1000`), else None (its `ts` are epoch µs, or relative).
    """

    events: list[Any]
    base_ns: int | None


def read_trace(path: str | os.PathLike[str]) -> KinetoTrace:
    """Read a Kineto (PyTorch profiler) or Chrome trace: the one reader of the format, used by
    the importer and by `kvscope timeline --merge`.

    Accepts the JSON Object form (``{"traceEvents": [...]}``) and Chrome's JSON Array form
    (a bare list of events), plain or gzip-compressed (detected by content, not by name).

    Raises:
        InputError: missing or unreadable file, cut or invalid JSON, no `traceEvents` list, or
            a `baseTimeNanoseconds` that is not an integer.
    """
    p = Path(path)
    return _parse_trace(read_bytes(p), p)


def _parse_trace(data: bytes, p: Path) -> KinetoTrace:
    doc = parse_json(data, p)
    if isinstance(doc, list):  # the JSON Array Format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise InputError(f"{p}: no 'traceEvents' list (not a Chrome/Kineto trace)")
    return KinetoTrace(doc["traceEvents"], _base_ns(doc.get("baseTimeNanoseconds"), p))


def _base_ns(base: Any, p: Path) -> int | None:
    """`baseTimeNanoseconds` as an int, checked (InputError when it is not one in range)."""
    if base is not None:
        if isinstance(base, bool) or not isinstance(base, int | float | str):
            raise InputError(f"{p}: baseTimeNanoseconds must be an integer, got {base!r}")
        try:
            base = int(base)
        except (TypeError, ValueError, OverflowError):
            raise InputError(f"{p}: baseTimeNanoseconds must be an integer, got {base!r}"
                             ) from None
        if not 0 <= base <= TIME_NS_MAX:
            raise InputError(f"{p}: baseTimeNanoseconds {base} is out of range (0 .. "
                             f"{TIME_NS_MAX})")
    return base


def load_kineto(path: Path) -> ImportedRun:
    """Import a Kineto trace.

    Args:
        path: a Chrome-trace JSON written by the PyTorch profiler, optionally gzipped.
    Returns:
        An ImportedRun with state/step spans from ``kvscope.*`` annotations, ``h2d`` activity
        spans and a `summary` of kernels, runtime calls, syncs, copies and flows.
    Raises:
        InputError: as `read_trace`, and for an event whose fields are not what the Chrome
            trace format says (``<file>: traceEvents[<i>]: <field>: ...``).
    """
    data, ids = _read_beside(path, lambda: _run_ids(path))
    ev, base = read_events(path, data)
    run = ImportedRun.empty("kineto", path)
    n_events = len(ev.complete)

    def pick(cat: str) -> np.ndarray:
        return np.flatnonzero(ev.complete & (ev.cats == _CAT_CODE[cat]))

    def times(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        start = us_to_ns(ev.ts[idx])
        if base is not None:
            start = start + int(base)
        return start, start + us_to_ns(ev.dur[idx])

    if not n_events:
        run.cannot.append("everything: the trace holds no events (nothing to import)")
    elif not ev.complete.any():
        run.cannot.append(f"durations: none of the {n_events} event(s) is a complete "
                          "(ph X) event, so there are no kernels, copies or ranges to read")
    if base is None and ev.complete.any() and float(ev.ts[ev.complete][0]) < _EPOCH_FLOOR_US:
        run.cannot.append("epoch times: no baseTimeNanoseconds and ts is not epoch µs; "
                          "times are relative to the trace start")
    renamed = {raw: c for raw, c in ev.spelled.items() if raw != CATEGORIES[raw.lower()]}
    if renamed:
        run.derived.append(
            "categories matched case-insensitively and by their older libkineto names: "
            + ", ".join(f"{raw} → {CATEGORIES[raw.lower()]} ({c:,})"
                        for raw, c in sorted(renamed.items())))

    def total(cat: str) -> dict[str, int]:
        start, end = times(pick(cat))
        return {"count": len(start), "total_ns": int((end - start).sum())}

    copies = pick("gpu_memcpy")
    run.summary = {
        "events": n_events,
        "kernels": total("kernel"),
        "cuda_sync": total("cuda_sync"),
        "cuda_runtime": total("cuda_runtime"),
        "gpu_memset": total("gpu_memset"),
        "memcpy": _copies(copies, ev, times, path),
        "flows": ev.flows(),
        "base_time_ns": base,
        "categories": dict(sorted(ev.spelled.items())),
    }
    spans = _h2d(run, copies, ev, times)
    spans += _annotations(run, pick("user_annotation"), ev, times, ids, path)
    run.spans = concat_span_tables(spans)
    run.cannot.append("token sources (hits, loads, recompute): accounting columns left <NA>")
    k = run.summary["kernels"]
    if k["count"]:
        run.can.append(f"kernel summary: {k['count']:,} kernels, {fmt_ns(k['total_ns'])} "
                       "on the GPU")
    elif n_events:
        run.cannot.append("kernel summary: no kernel events (cat `kernel`) in this trace")
    return run


@dataclass(slots=True)
class _Events:
    """The fields of every event the importer reads, validated once."""

    cats: np.ndarray  # int8: `_CAT_CODE` of the category read, 0 for others
    complete: np.ndarray  # ph == "X"
    names: Sequence[str | None]  # None (or "") where absent
    args: Sequence[Mapping[str, Any]]  # {} where absent; read only for copies and annotations
    ts: np.ndarray  # µs, NaN where absent
    dur: np.ndarray  # µs, 0 where absent
    spelled: dict[str, int]  # each `cat` spelling we read → its event count
    #: the `flows` summary (starts, finishes, finishes_without_start), computed when asked
    #: for: after the copies, so that a bad copy is reported before a bad flow id, as ever
    flows: Callable[[], dict[str, int]]

    def name(self, i: int) -> str:
        return self.names[i] or ""


def read_events(path: Path, data: bytes | None = None) -> tuple[_Events, int | None]:
    """The checked columns of a trace's events and its `baseTimeNanoseconds`.

    The typed decode (`_fast_events`) when msgspec is installed and the trace passes its
    checks; otherwise the general path (`read_trace` + `_columns`), which gives the same
    `_Events` for every trace it accepts and names the first field at fault for the others.

    Args:
        path: the trace.
        data: its bytes as `read_bytes` gives them, when already read.
    Raises:
        InputError: as `read_trace` and `_columns`.
    """
    if data is None:
        data = read_bytes(path)
    if msgspec is not None:
        fast = _fast_events(data, path)
        if fast is not None:
            return fast
    trace = _parse_trace(data, path)
    return _columns(trace.events, path, trace.base_ns or 0), trace.base_ns


def _read_beside(path: Path, work: Callable[[], _T]) -> tuple[bytes, _T]:
    """`read_bytes(path)` on a thread while `work` runs on this one, and both results (or the
    read's InputError, raised here once `work` is done): the read waits on the file and copies
    without the GIL, so `work` (the run store's requests: imports, a Parquet read) overlaps."""
    out: list[bytes | BaseException] = []

    def read() -> None:
        try:
            out.append(read_bytes(path))
        except BaseException as exc:  # handed to the caller as it is
            out.append(exc)

    reader = threading.Thread(target=read, name="kvscope-kineto-read", daemon=True)
    try:
        reader.start()
    except RuntimeError:  # no thread to be had (a process at its limit): one after the other
        res = work()
        return read_bytes(path), res
    try:
        res = work()
    finally:
        reader.join()
    data = out[0]
    if isinstance(data, BaseException):
        raise data
    return data, res


def _columns(events: list[Any], path: Path, base: int) -> _Events:
    """Check and collect the fields of every event (one pass).

    Raises:
        InputError: ``<file>: traceEvents[<i>]: <field>: ...`` for an event that is not an
            object, a ph/cat/name that is not a string, args that are not an object, or a
            ts/dur that is not a finite number (dur: >= 0) within int64 ns.
    """
    n = len(events)
    cats = np.zeros(n, dtype=np.int8)
    complete = np.zeros(n, dtype=bool)
    phs: list[str] = [""] * n
    names: list[str] = [""] * n
    args: list[dict[str, Any]] = [{}] * n
    ts = np.full(n, np.nan)
    dur = np.zeros(n)
    spelled: dict[str, int] = {}
    for i, e in enumerate(events):
        rec = f"traceEvents[{i}]"
        if not isinstance(e, dict):
            raise field_error(path, rec, "event", f"expected an object, got {shown(e)}")
        ph = e.get("ph")
        if not isinstance(ph, str):
            raise field_error(path, rec, "ph", "missing" if ph is None else
                              f"expected a string, got {shown(ph)}")
        phs[i] = ph
        cat = e.get("cat")
        if cat is not None:
            if not isinstance(cat, str):
                raise field_error(path, rec, "cat", f"expected a string, got {shown(cat)}")
            read = CATEGORIES.get(cat.lower())
            if read is not None:
                cats[i] = _CAT_CODE[read]
                spelled[cat] = spelled.get(cat, 0) + 1
        name = e.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise field_error(path, rec, "name", f"expected a string, got {shown(name)}")
            names[i] = name
        a = e.get("args")
        if a is not None:
            if not isinstance(a, dict):
                raise field_error(path, rec, "args", f"expected an object, got {shown(a)}")
            args[i] = a
        t = e.get("ts")
        if ph == "X" or t is not None:
            if t is None:
                raise field_error(path, rec, "ts", "missing (a complete event needs one)")
            ts[i] = number_field(t, path, rec, "ts", lo=-_US_MAX, hi=_US_MAX)
        if ph == "X":
            complete[i] = True
            d = e.get("dur")
            if d is None:
                raise field_error(path, rec, "dur", "missing (a complete event needs one)")
            dur[i] = number_field(d, path, rec, "dur", lo=0, hi=_US_MAX)
    if complete.any():  # base + ts + dur must still be an int64 ns
        end = base + ts[complete] * 1000 + dur[complete] * 1000
        bad = np.flatnonzero((end > TIME_NS_MAX) | (end < -TIME_NS_MAX))
        if len(bad):
            i = int(np.flatnonzero(complete)[bad[0]])
            raise field_error(path, f"traceEvents[{i}]", "ts",
                              f"{events[i]['ts']!r} µs + dur + baseTimeNanoseconds is beyond "
                              "int64 ns")
    return _Events(cats, complete, names, args, ts, dur, spelled,
                   lambda: _flows(events, phs, path))


# ---------------------------------------------------------------------------------------------
# The typed decode: only the fields read, `args` kept as raw JSON but for the keys copies and
# annotations read, each field's JSON type checked by the decoder and the numbers in bulk.
# ---------------------------------------------------------------------------------------------

#: `args` keys the importer reads (attribute → key): copies' bytes and correlation, the request
#: of a bare ``kvscope.<stage>`` range.
_ARG_KEYS: tuple[tuple[str, str], ...] = (
    ("bytes", "bytes"), ("correlation", "correlation"), ("request_num", "request_num"),
    ("request_id", "request_id"), ("kvscope_request_num", "kvscope.request_num"),
    ("concrete_inputs", "Concrete Inputs"),
)

#: the phases of the Chrome trace event format ("Trace Event Format", Google), what the typed
#: decode reads as `ph`
_Phase = Literal["B", "E", "X", "i", "I", "C", "b", "n", "e", "s", "t", "f", "P", "O", "N", "D",
                 "M", "V", "v", "R", "c", "(", ")"]

if msgspec is not None:
    class _Args(msgspec.Struct, gc=False):
        """An event's `args`: the keys read, each left as raw JSON (decoded when read)."""

        bytes: msgspec.Raw = None  # type: ignore[assignment]
        correlation: msgspec.Raw = None  # type: ignore[assignment]
        request_num: msgspec.Raw = None  # type: ignore[assignment]
        request_id: msgspec.Raw = None  # type: ignore[assignment]
        kvscope_request_num: msgspec.Raw = msgspec.field(  # type: ignore[assignment]
            default=None, name="kvscope.request_num")
        concrete_inputs: msgspec.Raw = msgspec.field(  # type: ignore[assignment]
            default=None, name="Concrete Inputs")

    class _Event(msgspec.Struct, gc=False):
        # ph: one of the format's phases, decoded to one shared str each (cheaper to make,
        # hash and free than a new one per event); another ph is read by the general path.
        # ts/dur: NaN where absent (a JSON number is never NaN), so that a column of them is
        # one `fromiter` (None only where the trace writes null).
        ph: _Phase
        cat: str | None = None
        name: str | None = None
        ts: float | None = math.nan
        dur: float | None = math.nan
        id: str | int | float | None = None
        args: _Args | None = None

    class _Doc(msgspec.Struct, gc=False):
        traceEvents: list[_Event]  # the format's keys
        baseTimeNanoseconds: int | None = None

    _DECODER = msgspec.json.Decoder(_Doc | list[_Event])


class _LazyArgs(Sequence[Mapping[str, Any]]):
    """`args` of the decoded events as dicts of the keys read, decoded on access."""

    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, i: int) -> Mapping[str, Any]:  # type: ignore[override]
        a = self._events[i].args
        if a is None:
            return {}
        return {key: msgspec.json.decode(raw) for attr, key in _ARG_KEYS
                if (raw := getattr(a, attr)) is not None}


def _fast_events(data: bytes, path: Path) -> tuple[_Events, int | None] | None:
    """`_Events` through the typed decode, or None when the trace fails any check there (the
    general path then reads it, and names what is wrong, or reads what the decoder's types
    do not cover)."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        doc = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if isinstance(doc, list):
        events, base = doc, None
    else:
        events, base = doc.traceEvents, doc.baseTimeNanoseconds
        if base is not None and not 0 <= base <= TIME_NS_MAX:
            return None
    n = len(events)
    ph_code, phs = _codes(map(_PH, events), n)
    complete = _is(ph_code, phs, "X")
    ts = _floats(events, _TS, n)  # absent or null → NaN
    # the complete events' dur (the others' is never read); NaN for a complete event without
    # one, which the check below hands to the general path (it names it)
    dur_c = _floats(events, _DUR, n)[complete]
    ts_c = ts[complete]
    with np.errstate(invalid="ignore"):
        present = ~np.isnan(ts)
        if (np.isnan(ts_c).any() or np.isnan(dur_c).any()
                or (np.abs(ts[present]) > _US_MAX).any()
                or (dur_c < 0).any() or (dur_c > _US_MAX).any()):
            return None  # a missing or out-of-range ts/dur: the general path names it
    if len(ts_c):
        end = (base or 0) + ts_c * 1000 + dur_c * 1000
        if ((end > TIME_NS_MAX) | (end < -TIME_NS_MAX)).any():
            return None
    dur = np.zeros(n)
    dur[complete] = dur_c

    cat_code, raw_cats = _codes(map(_CAT, events), n)
    counts = np.bincount(cat_code, minlength=len(raw_cats)).tolist()
    read = [None if c is None else CATEGORIES.get(c.lower()) for c in raw_cats]
    # each spelling read → its count, in the order first seen (as a Counter gave them)
    spelled = {c: k for c, r, k in zip(raw_cats, read, counts, strict=True) if r is not None}
    lut = np.array([0 if r is None else _CAT_CODE[r] for r in read], dtype=np.int8)
    cats = lut[cat_code]

    return _Events(cats, complete, _LazyNames(events), _LazyArgs(events), ts, dur, spelled,
                   lambda: _fast_flows(events, ph_code, phs)), base


_PH, _CAT, _TS, _DUR = (attrgetter(f) for f in ("ph", "cat", "ts", "dur"))


def _codes(values: Iterable[Any], n: int) -> tuple[np.ndarray, list[Any]]:
    """Each of the `n` values' index among the distinct values (in the order first seen), and
    those values: one pass, a dict lookup per value."""
    index = _Index()
    return np.fromiter(map(index.__getitem__, values), dtype=np.int32, count=n), list(index)


class _Index(dict[Any, int]):
    """value → the number of distinct values before it (assigned on its first lookup)."""

    def __missing__(self, key: Any) -> int:
        code = self[key] = len(self)
        return code


def _is(code: np.ndarray, of_code: list[Any], value: Any) -> np.ndarray:
    """Where `code` stands for `value` (`of_code[c]`: what code c stands for)."""
    return np.array([v == value for v in of_code], dtype=bool)[code]


def _floats(events: list[Any], get: Callable[[Any], float | None], n: int) -> np.ndarray:
    """A float field of every decoded event, NaN where it is None (or absent: NaN)."""
    try:  # straight from the events when none is null (as a rule)
        return np.fromiter(map(get, events), dtype=np.float64, count=n)
    except TypeError:  # a None
        return np.array(list(map(get, events)), dtype=np.float64)


class _LazyNames(Sequence[str | None]):
    """`name` of the decoded events, read on access (only copies' and annotations' are)."""

    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, i: int) -> str | None:  # type: ignore[override]
        return self._events[i].name


def _fast_flows(events: list[Any], ph_code: np.ndarray, phs: list[str]) -> dict[str, int]:
    """`_flows` over decoded events (their ids were typed by the decoder: nothing to check);
    `phs[ph_code[i]]` is event i's ph."""
    idx_s = np.flatnonzero(_is(ph_code, phs, "s"))
    idx_f = np.flatnonzero(_is(ph_code, phs, "f"))

    def key(i: int) -> tuple[str | None, Any]:
        e = events[i]
        return e.cat, e.id

    starts = {key(i) for i in idx_s.tolist()}
    ends = [key(i) for i in idx_f.tolist()]
    return {"starts": len(idx_s), "finishes": len(idx_f),
            "finishes_without_start": sum(1 for k in ends if k not in starts)}


def _bytes_of(ev: _Events, i: int, path: Path) -> int | None:
    """A copy's ``args.bytes``: None when the event has none; a bad value is an error."""
    v = ev.args[i].get("bytes")
    return None if v is None else count_field(v, path, f"traceEvents[{i}]", "args.bytes")


def _copies(idx: np.ndarray, ev: _Events, times: Any, path: Path) -> dict[str, dict[str, int]]:
    if not len(idx):
        return {}
    start, end = times(idx)
    # "Memcpy HtoD (Pinned -> Device)" → "HtoD"
    kinds = np.array([[*ev.name(i).split(), "?", "?"][1] for i in idx], dtype=object)
    nb = [_bytes_of(ev, int(i), path) for i in idx]
    has = np.array([b is not None for b in nb], dtype=bool)
    nbytes = np.array([b or 0 for b in nb], dtype=object)  # python ints: sums cannot wrap
    out = {}
    for k in sorted(set(kinds)):
        m = kinds == k
        out[k] = {"count": int(m.sum()), "bytes": int(nbytes[m].sum()),
                  "with_bytes": int((m & has).sum()), "without_bytes": int((m & ~has).sum()),
                  "total_ns": int((end[m] - start[m]).sum())}
    return out


def _flows(events: list[Any], phs: list[str], path: Path) -> dict[str, int]:
    def key(i: int) -> tuple[str, Any]:
        fid = events[i].get("id")
        if fid is not None and not isinstance(fid, str) and not (
                is_number(fid) and math.isfinite(fid)):
            raise field_error(path, f"traceEvents[{i}]", "id",
                              f"expected a string or a number, got {shown(fid)}")
        return events[i].get("cat"), fid

    idx_s = [i for i, p in enumerate(phs) if p == "s"]
    idx_f = [i for i, p in enumerate(phs) if p == "f"]
    starts = {key(i) for i in idx_s}
    ends = [key(i) for i in idx_f]
    return {"starts": len(idx_s), "finishes": len(idx_f),
            "finishes_without_start": sum(1 for k in ends if k not in starts)}


def _h2d(run: ImportedRun, copies: np.ndarray, ev: _Events, times: Any) -> list[pa.Table]:
    """The ``h2d`` activity spans (a list of one table, or none), and their notes on `run`."""
    path = run.path
    h2d = np.array([i for i in copies if ev.name(i).startswith("Memcpy HtoD")], dtype=np.int64)
    if not len(h2d):
        run.cannot.append("h2d activity: no `Memcpy HtoD` events in this trace")
        return []
    start, end = times(h2d)
    nbytes = [_bytes_of(ev, int(i), path) for i in h2d]
    corr = []
    for i in h2d:
        c = ev.args[i].get("correlation")
        corr.append(None if c is None else count_field(c, path, f"traceEvents[{i}]",
                                                       "args.correlation"))
    n = len(h2d)
    table = spans_table({
        "kind": ["activity"] * n, "name": ["h2d"] * n, "start_ns": start, "end_ns": end,
        "tier": ["host"] * n, "bytes": nbytes, "transfer_id": corr,
        "clock": ["cuda_event"] * n}, n)
    known = [b for b in nbytes if b is not None]
    unknown = n - len(known)
    run.can.append(f"h2d activity: {n:,} `Memcpy HtoD` copies (not linked to requests), "
                   f"{len(known):,} with bytes ({sum(known):,} bytes)"
                   + (f", {unknown:,} without a bytes argument" if unknown else ""))
    if unknown:
        run.cannot.append(f"bytes of {unknown:,} of {n:,} `Memcpy HtoD` copies: the events "
                          "have no `bytes` argument (left unknown, not counted as 0)")
    return [table]


def _run_ids(path: Path) -> dict[int, str]:
    """request_num → request_id from the run store the trace sits in ({} when none)."""
    for d in (path.parent, path.parent.parent):
        if (d / "run.json").is_file():
            from agent.runstore.reader import open_run

            try:  # the Arrow table: reading it as a DataFrame would load pandas
                req = open_run(d, tables=("requests",), columns={
                    "requests": ("request_num", "request_id")}).tables["requests"]
            except (InputError, OSError):
                return {}  # not a readable run store: fall back to request_num as the id
            nums = [-1 if n is None else n for n in req["request_num"].to_pylist()]
            return dict(zip(nums, map(str, req["request_id"].to_pylist()), strict=True))
    return {}


def _request_of(args: Mapping[str, Any], path: Path, rec: str) -> str | None:
    for k in _REQ_KEYS:
        v = args.get(k)
        if v in (None, ""):
            continue
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise field_error(path, rec, f"args.{k}",
                              f"expected an integer or a string, got {shown(v)}")
        if isinstance(v, int) and not -INT64_MAX <= v <= INT64_MAX:
            raise field_error(path, rec, f"args.{k}", f"{v} is out of range")
        return str(v)
    ci = args.get("Concrete Inputs")
    if isinstance(ci, list) and ci and isinstance(ci[0], str | int) and not isinstance(
            ci[0], bool) and str(ci[0]).lstrip("-").isdigit():
        return str(ci[0])
    return None


def split_name(name: str) -> tuple[str, int | None]:
    """``kvscope.queue#12`` → ("queue", 12); ``kvscope.queue`` → ("queue", None).

    Args:
        name: a range name starting with ``kvscope.``.
    Returns:
        The stage or phase name and the integer payload (request_num or step id), None when
        the name has no ``#<integer>`` suffix.
    """
    base, sep, tail = name[len(PREFIX):].rpartition("#")
    if sep and tail.lstrip("-").isdigit() and tail.isascii() and len(tail) <= 19:
        n = int(tail)
        if -INT64_MAX <= n <= INT64_MAX:
            return base, n
    return name[len(PREFIX):], None


def _annotations(run: ImportedRun, ann: np.ndarray, ev: _Events, times: Any,
                 ids: dict[int, str], path: Path) -> list[pa.Table]:
    """The spans of ``kvscope.*`` ranges (step, activity, then state span tables); sets
    `run.requests` when there are state ranges."""
    ours = np.array([i for i in ann if ev.name(i).startswith(PREFIX)], dtype=np.int64)
    if not len(ours):
        run.cannot.append(f"TTFT stages: no `{PREFIX}<stage>` user annotations (trace not "
                          "recorded by `kvscope run --profile`)")
        return []
    parsed = [split_name(ev.name(i)) for i in ours]
    names = np.array([n for n, _ in parsed], dtype=object)
    payload = [p for _, p in parsed]
    start, end = times(ours)
    is_state = np.isin(names, np.array(STATES, dtype=object))
    is_step = np.isin(names, np.array(STEP_PHASES, dtype=object))
    frames: list[pa.Table] = []

    if is_step.any():
        m = np.flatnonzero(is_step)
        frames.append(spans_table({
            "kind": ["step"] * len(m), "name": names[m], "start_ns": start[m], "end_ns": end[m],
            "step_id": [payload[i] for i in m], "clock": ["cpu"] * len(m)}, len(m)))
    other = np.flatnonzero(~is_state & ~is_step)
    if len(other):
        frames.append(spans_table({
            "kind": ["activity"] * len(other), "name": names[other], "start_ns": start[other],
            "end_ns": end[other], "clock": ["cpu"] * len(other)}, len(other)))

    st = np.flatnonzero(is_state)
    if len(st):
        keys = [str(payload[i]) if payload[i] is not None
                else _request_of(ev.args[ours[i]], path, f"traceEvents[{ours[i]}]")
                for i in st]
        synthetic = all(k is None for k in keys)
        keys = ["kineto-0" if k is None else k for k in keys]
        uniq, req = np.unique(np.array(keys, dtype=object), return_inverse=True)
        nums = _nums(uniq)
        rid = np.array([ids.get(int(n), u) for n, u in zip(nums, uniq, strict=True)],
                       dtype=object) if ids else uniq
        frames.append(stage_range_tables(
            run, req, names[st], start[st], end[st], rid, nums, f"`{PREFIX}<stage>` ranges"))
        if ids:
            run.derived.append("request ids: request_num → request_id from the run store "
                               "beside the trace")
        if synthetic:
            run.cannot.append("per-request split: the annotations carry no request, so all "
                              "ranges form one synthetic request `kineto-0`")
    return frames


def _nums(ids: np.ndarray) -> np.ndarray:
    """request_num: the id itself when numeric (the range suffix), else its position."""
    try:
        nums = [int(x) for x in ids]
    except ValueError:
        return np.arange(len(ids), dtype=np.int64)
    if any(not -INT64_MAX <= x <= INT64_MAX for x in nums):
        return np.arange(len(ids), dtype=np.int64)
    return np.array(nums, dtype=np.int64)
