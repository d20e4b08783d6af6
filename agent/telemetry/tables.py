"""Drained recorder segments → Arrow tables of the run-store schemas (epoch ns).

Integer columns are handed over zero-copy where they need no conversion; small integer codes
become strings through their vocabulary (dictionary decode in C++).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from agent.schema import (
    BLOCK_STATES,
    CLOCKS,
    EVENTS_SCHEMA,
    LAYERS_SCHEMA,
    REQUESTS_SCHEMA,
    SAMPLES_SCHEMA,
    SPANS_SCHEMA,
    STATES,
    TIERS,
)
from agent.telemetry.buffers import Chunk, chunk_waits, coded_strings, concat_column, int_array

#: Activity-buffer kind codes (agent.telemetry.codes.KIND_*) → span kind.
_ACTIVITY_KINDS = ("activity", "ledger")

LAYER_COLS = ("request_num", "layer", "hit_tokens", "loaded_tokens", "recomputed_tokens",
              "prompt_tokens", "load_ns", "wait_ns", "skipped_tokens")


class IdLookup(Protocol):
    """request_num → request_id (a dict, or the recorder's view with late-resolved ids)."""

    def get(self, rn: int, /) -> str | None: ...


def request_ids(nums: np.ndarray, ids: IdLookup) -> pa.Array:
    """The request_id of every row (null for negative or unknown numbers), one lookup per
    distinct number."""
    uniq, inverse = np.unique(nums, return_inverse=True)
    vocab = [ids.get(int(u)) if u >= 0 else None for u in uniq]
    return pa.array(vocab, type=pa.string()).take(pa.array(inverse.astype(np.int64)))


def state_table(segs: list[Chunk], ids: IdLookup, off: int) -> pa.Table:
    rn = concat_column(segs, 0)
    n = len(rn)
    waits = chunk_waits(segs)
    cols = {
        "request_id": request_ids(rn, ids),
        "request_num": pa.array(rn),
        "kind": pa.repeat(pa.scalar("state"), n),
        "name": coded_strings(concat_column(segs, 1), list(STATES)),
        "start_ns": pa.array(concat_column(segs, 2) + off),
        "end_ns": pa.array(concat_column(segs, 3) + off),
        "tier": pa.nulls(n, pa.string()),
        "layer": pa.nulls(n, pa.int32()),
        "tokens": pa.nulls(n, pa.int64()),
        "bytes": pa.nulls(n, pa.int64()),
        "step_id": pa.nulls(n, pa.int64()),
        "transfer_id": pa.nulls(n, pa.int64()),
        "waits_on": pa.nulls(n, pa.list_(pa.int64())) if waits is None
        else pa.array(waits, pa.list_(pa.int64())),
        "clock": pa.repeat(pa.scalar(CLOCKS[0]), n),
        "batch_requests": pa.nulls(n, pa.int32()),
        "block": pa.nulls(n, pa.int32()),
    }
    return pa.table(cols, schema=SPANS_SCHEMA)


def activity_table(segs: list[Chunk], ids: IdLookup, names: list[str],
                    off: int) -> pa.Table:
    rn = concat_column(segs, 0)
    n = len(rn)
    cols = {
        "request_id": request_ids(rn, ids),
        "request_num": int_array(rn, 0),
        "kind": coded_strings(concat_column(segs, 10), list(_ACTIVITY_KINDS)),
        "name": coded_strings(concat_column(segs, 1), names),
        "start_ns": pa.array(concat_column(segs, 2) + off),
        "end_ns": pa.array(concat_column(segs, 3) + off),
        "tier": coded_strings(concat_column(segs, 4), list(TIERS)),
        "layer": int_array(concat_column(segs, 5), 0, pa.int32()),
        "tokens": int_array(concat_column(segs, 6), 0),
        "bytes": int_array(concat_column(segs, 7), 0),
        "step_id": pa.nulls(n, pa.int64()),
        "transfer_id": int_array(concat_column(segs, 8), 0),
        "waits_on": pa.nulls(n, pa.list_(pa.int64())),
        "clock": coded_strings(concat_column(segs, 9), list(CLOCKS)),
        "batch_requests": pa.nulls(n, pa.int32()),
        "block": int_array(concat_column(segs, 11), 0, pa.int32()),
    }
    return pa.table(cols, schema=SPANS_SCHEMA)


#: The packed row of one engine step (`Recorder.engine_step`): its phase times, the forward's
#: (-1, -1: none, its span recorded apart), the batch, and the pools' occupancy (host -1: none).
ENGINE_STEP_COLS = ("step_id", "t0", "t1", "t2", "t3", "t4", "forward_start", "forward_end",
                    "batch_requests", "tokens", "device_in_use", "device_cached_free",
                    "device_empty", "host_in_use", "host_cached_free", "host_empty")
#: Phases of an engine step's spans, in the order they are recorded.
_STEP_ORDER = ("schedule", "prepare", "sample", "forward")


def _expand(per_step: list[np.ndarray], keep: np.ndarray | None) -> np.ndarray:
    """Row-wise interleave of per-step columns (step 0's values, then step 1's, ...), keeping
    the entries `keep` (n × len(per_step)) marks."""
    m = np.stack(per_step, axis=1)
    return m.ravel() if keep is None else m[keep]


def step_table(segs: list[Chunk], names: list[str], off: int, steps: list[Chunk] | None = None
               ) -> pa.Table:
    """Step spans: those of `engine_step` rows (`steps`, each expanded to its phases in
    `_STEP_ORDER`), then those recorded one by one (`segs`)."""
    cols = [np.empty(0, np.int64) for _ in range(7)]  # step_id, name, start, end, batch, tok, clock
    if steps:
        c = [concat_column(steps, j) for j in range(10)]
        n = len(c[0])
        has_fwd = (c[6] != -1) | (c[7] != -1)
        keep = None
        if not has_fwd.all():
            keep = np.ones((n, 4), dtype=bool)
            keep[:, 3] = has_fwd
        per = 4 if keep is None else keep.sum(axis=1)
        codes = np.array([names.index(p) for p in _STEP_ORDER], dtype=np.int64)
        cols = [np.repeat(c[0], per), _expand([np.broadcast_to(x, n) for x in codes], keep),
                _expand([c[1], c[2], c[4], c[6]], keep), _expand([c[2], c[3], c[5], c[7]], keep),
                np.repeat(c[8], per), np.repeat(c[9], per),
                np.zeros(n * 4 if keep is None else int(keep.sum()), dtype=np.int64)]
    if segs:
        legacy = [concat_column(segs, j) for j in range(7)]
        cols = legacy if not steps else [np.concatenate(p) for p in zip(cols, legacy,
                                                                         strict=True)]
    step, name, start, end, batch, tokens, clock = cols
    n = len(step)
    table = {
        "request_id": pa.nulls(n, pa.string()),
        "request_num": pa.nulls(n, pa.int64()),
        "kind": pa.repeat(pa.scalar("step"), n),
        "name": coded_strings(name, names),
        "start_ns": pa.array(start + off),
        "end_ns": pa.array(end + off),
        "tier": pa.nulls(n, pa.string()),
        "layer": pa.nulls(n, pa.int32()),
        "tokens": int_array(tokens, 0),
        "bytes": pa.nulls(n, pa.int64()),
        "step_id": pa.array(step),
        "transfer_id": pa.nulls(n, pa.int64()),
        "waits_on": pa.nulls(n, pa.list_(pa.int64())),
        "clock": coded_strings(clock, list(CLOCKS)),
        "batch_requests": int_array(batch, 0, pa.int32()),
        "block": pa.nulls(n, pa.int32()),
    }
    return pa.table(table, schema=SPANS_SCHEMA)


def layers_table(segs: list[Chunk], ids: IdLookup) -> pa.Table:
    rn = concat_column(segs, 0)
    cols: dict[str, pa.Array] = {"request_id": request_ids(rn, ids)}
    cols["layer"] = pa.array(concat_column(segs, 1).astype(np.int32))
    for j, name in enumerate(LAYER_COLS[2:], start=2):
        cols[name] = pa.array(concat_column(segs, j))
    return pa.table(cols, schema=LAYERS_SCHEMA)


def requests_table(rows: list[tuple[Any, ...]], off: int) -> pa.Table:
    cols = list(zip(*rows, strict=True))
    data: dict[str, Any] = {}
    for i, f in enumerate(REQUESTS_SCHEMA):
        v = list(cols[i])
        if f.name in ("arrival_ns", "first_token_ns", "finish_ns"):
            v = [None if x is None else x + off for x in v]
        elif f.name == "output_token_ids":
            v = [None if x is None else x.tolist() for x in v]
        data[f.name] = pa.array(v, f.type)
    return pa.table(data, schema=REQUESTS_SCHEMA)


# NOTE: the samples and events columns are built from buffers. `pa.array()` probes its input with
# pandas' type checks and imports pandas when it is installed (~0.5 s and tens of MiB); the node
# agent must stay free of it, and building the buffers directly costs less anyway.


def _int64(values: tuple[int, ...], offset: int = 0) -> pa.Array:
    buf = np.fromiter(values, dtype=np.int64, count=len(values))
    if offset:
        buf += offset
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(buf)])


def _float64(values: tuple[float, ...]) -> pa.Array:
    buf = np.fromiter(values, dtype=np.float64, count=len(values))
    return pa.Array.from_buffers(pa.float64(), len(values), [None, pa.py_buffer(buf)])


def _string(values: tuple[str | None, ...] | list[str | None]) -> pa.Array:
    n = len(values)
    # Sample and event columns repeat a few values (sources, metrics, entities, units): each
    # distinct value is encoded once and the per-row work is C-level lookups (map), not a
    # Python loop. errors="replace": a lone surrogate becomes U+FFFD instead of failing the
    # whole table.
    try:
        distinct = dict.fromkeys(values)
    except TypeError:  # an unhashable value: str() of each
        distinct = {}
    if all(v is None or type(v) is str for v in distinct) and distinct:
        codes = {v: b"" if v is None else v.encode("utf-8", "replace") for v in distinct}
        enc = list(map(codes.__getitem__, values))
    else:  # other types (1 and 1.0 are one dict key): each value's own str()
        enc = [b"" if v is None else str(v).encode("utf-8", "replace") for v in values]
        codes = dict.fromkeys([None]) if any(v is None for v in values) else {}
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, enc), dtype=np.int32, count=n), out=offsets[1:])
    nulls = 0
    bitmap = None
    if None in codes:
        valid = np.fromiter(map(operator.is_not, values, repeat(None)), dtype=bool, count=n)
        nulls = n - int(valid.sum())
        bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(pa.string(), n, [bitmap, pa.py_buffer(offsets),
                                                  pa.py_buffer(b"".join(enc))], null_count=nulls)


def samples_table(rows: Sequence[tuple[Any, ...]], off: int) -> pa.Table:
    """Sample rows `(ts, source, entity, metric, value, unit)` (monotonic ts) → a `samples`
    table in epoch ns. The one builder of the table: the recorder's drain and the node
    agent's store both use it."""
    ts, source, entity, metric, value, unit = zip(*rows, strict=True)
    return pa.Table.from_arrays(
        [_int64(ts, off), _string(source), _string(entity), _string(metric), _float64(value),
         _string(unit)],
        schema=SAMPLES_SCHEMA,
    )


def engine_samples_table(steps: list[Chunk], rows: Sequence[tuple[Any, ...]], off: int
                         ) -> pa.Table:
    """The `samples` table of `engine_step` rows (`steps`: per step its device pool's three
    states, then the host tier's, at the step's t4) merged with sample rows recorded one by
    one (`rows`, as `samples_table`) in the order they were recorded: a row recorded at t
    follows every step sample at or before t (the rows' own order is kept)."""
    if not steps:
        return samples_table(rows, off)
    c = [concat_column(steps, j) for j in (5, 10, 11, 12, 13, 14, 15)]
    n = len(c[0])
    has_host = c[4] != -1
    keep = None
    if not has_host.all():
        keep = np.ones((n, 6), dtype=bool)
        keep[:, 3:] = has_host[:, None]
    ts = np.repeat(c[0], 6 if keep is None else keep.sum(axis=1))
    m = len(ts)
    nstates = len(BLOCK_STATES)
    entity = _expand([np.broadcast_to(np.int64(i // nstates), n) for i in range(6)], keep)
    metric = _expand([np.broadcast_to(np.int64(i % nstates), n) for i in range(6)], keep)
    value = _expand(c[1:], keep).astype(np.float64)
    pool = pa.Table.from_arrays(
        [pa.array(ts + off), pa.repeat(pa.scalar("pool"), m),
         coded_strings(entity, ["device", "host"]), coded_strings(metric, list(BLOCK_STATES)),
         pa.array(value), pa.repeat(pa.scalar("blocks"), m)], schema=SAMPLES_SCHEMA)
    if not rows:
        return pool
    other = samples_table(rows, off)
    keys = np.concatenate([ts, np.maximum.accumulate(
        np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows)))])
    both = pa.concat_tables([pool, other])
    if (np.diff(keys) >= 0).all():
        return both
    return both.take(pa.array(np.argsort(keys, kind="stable")))


def detail_json(detail: dict[str, Any] | None) -> str | None:
    """An event's detail as JSON text, keys sorted when they can be; never raises (the drain
    must not fail on one value)."""
    if detail is None:
        return None
    try:
        return json.dumps(detail, default=str, sort_keys=True)
    except TypeError:  # keys of mixed types cannot be sorted
        pass
    except Exception as exc:  # circular references, a failing __str__, ...
        return json.dumps({"unserializable": type(exc).__name__, "repr": _safe_repr(detail)})
    try:
        return json.dumps(detail, default=str)
    except Exception as exc:
        return json.dumps({"unserializable": type(exc).__name__, "repr": _safe_repr(detail)})


def _safe_repr(obj: Any) -> str:
    try:
        return repr(obj)[:1000]
    except Exception:
        return object.__repr__(obj)


def events_table(rows: Sequence[tuple[Any, ...]], off: int) -> pa.Table:
    """Event rows `(t, source, name, request_id, detail)` (monotonic t) → an `events` table in
    epoch ns, `detail` as JSON text (`detail_json`: never raises). The one builder of the table
    (the recorder's drain and the node agent's store)."""
    ts, source, name, rid, detail = zip(*rows, strict=True)
    return pa.Table.from_arrays(
        [_int64(ts, off), _string(source), _string(name), _string(rid),
         _string([detail_json(d) for d in detail])],
        schema=EVENTS_SCHEMA,
    )
