"""Drained recorder segments → Arrow tables of the run-store schemas (epoch ns).

Integer columns are handed over zero-copy where they need no conversion; small integer codes
become strings through their vocabulary (dictionary decode in C++).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from agent.schema import (
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


def step_table(segs: list[Chunk], names: list[str], off: int) -> pa.Table:
    step = concat_column(segs, 0)
    n = len(step)
    cols = {
        "request_id": pa.nulls(n, pa.string()),
        "request_num": pa.nulls(n, pa.int64()),
        "kind": pa.repeat(pa.scalar("step"), n),
        "name": coded_strings(concat_column(segs, 1), names),
        "start_ns": pa.array(concat_column(segs, 2) + off),
        "end_ns": pa.array(concat_column(segs, 3) + off),
        "tier": pa.nulls(n, pa.string()),
        "layer": pa.nulls(n, pa.int32()),
        "tokens": int_array(concat_column(segs, 5), 0),
        "bytes": pa.nulls(n, pa.int64()),
        "step_id": pa.array(step),
        "transfer_id": pa.nulls(n, pa.int64()),
        "waits_on": pa.nulls(n, pa.list_(pa.int64())),
        "clock": coded_strings(concat_column(segs, 6), list(CLOCKS)),
        "batch_requests": int_array(concat_column(segs, 4), 0, pa.int32()),
        "block": pa.nulls(n, pa.int32()),
    }
    return pa.table(cols, schema=SPANS_SCHEMA)


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
    # errors="replace": a lone surrogate becomes U+FFFD instead of failing the whole table.
    enc = [b"" if v is None else str(v).encode("utf-8", "replace") for v in values]
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, enc), dtype=np.int32, count=n), out=offsets[1:])
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=n)
    nulls = n - int(valid.sum())
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
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
