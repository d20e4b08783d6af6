"""Drained recorder segments → Arrow tables of the run-store schemas (epoch ns).

Integer columns are handed over zero-copy where they need no conversion; small integer codes
become strings through their vocabulary (one `take` in C++ for every string column of a
table).
"""

from __future__ import annotations

import json
import operator
import struct
from array import array
from collections.abc import Sequence
from functools import lru_cache
from itertools import chain, repeat, starmap
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
from agent.telemetry.buffers import Chunk

LAYER_COLS = ("request_num", "layer", "hit_tokens", "loaded_tokens", "recomputed_tokens",
              "prompt_tokens", "load_ns", "wait_ns", "skipped_tokens")


class IdLookup(Protocol):
    """request_num → request_id (a dict, or the recorder's view with late-resolved ids)."""

    def get(self, rn: int, /) -> str | None: ...


# The drain runs a few times a second on a drained batch of a few hundred rows, so its cost is
# the number of Arrow and numpy calls, not the rows: integer columns are made from whole numpy
# buffers (`pa.Array.from_buffers`, no per-row Python), the string columns of a table come from
# one `take` over one vocabulary, and the spans of the three buffers are one table.

_I64 = pa.int64()
_I32 = pa.int32()
_STR = pa.string()
_F64 = pa.float64()
_LIST_I64 = pa.list_(_I64)
_I64_MIN, _I64_MAX = -(2 ** 63), 2 ** 63 - 1
_I32_MAX = 2 ** 31 - 1


def _decode(codes: np.ndarray, vocab: pa.Array) -> pa.Array:
    """Codes into the string array `vocab` (-1: null) → a plain Arrow string array."""
    return _strings(codes.reshape(1, -1), [0], vocab)[0]


def _strings(codes: np.ndarray, bases: Sequence[int], vocab: pa.Array) -> list[pa.Array]:
    """String columns from rows of codes, gathered at once (one `take`, in C++): row j of
    `codes` (k × n) holds codes into `vocab` from `bases[j]` on (-1: null). The columns are
    slices of one array."""
    k, n = codes.shape
    valid = codes >= 0
    g = np.where(valid, codes + np.asarray(bases, dtype=np.int64)[:, None], 0).ravel()
    (bitmap,), (nulls,) = _bitmaps(valid.reshape(1, -1))
    idx = pa.Array.from_buffers(_I64, k * n, [bitmap, pa.py_buffer(g)], null_count=nulls)
    out = vocab.take(idx)
    return [out] if k == 1 else [out.slice(j * n, n) for j in range(k)]


def _bitmaps(valid: np.ndarray) -> tuple[list[pa.Buffer | None], list[int]]:
    """Per row of a (k × n) bool mask: its validity bitmap (None when nothing is null) and
    null count."""
    n = valid.shape[1]
    nulls = (n - valid.sum(axis=1)).tolist()
    if not any(nulls):
        return [None] * len(nulls), nulls
    bits = np.packbits(valid, axis=1, bitorder="little")
    return [pa.py_buffer(bits[j]) if nulls[j] else None for j in range(len(nulls))], nulls


def _ints(type_: pa.DataType, values: np.ndarray, valid: np.ndarray | None = None
          ) -> list[pa.Array]:
    """Integer columns over the rows of a C-contiguous (k × n) matrix of `type_`'s width
    (zero-copy); entries where `valid` (k × n) is False are null."""
    k, n = values.shape
    if valid is None:
        # One array over the whole matrix, sliced per column (a slice costs half of an array
        # built from its own buffer; the values are the same memory either way).
        whole = pa.Array.from_buffers(type_, k * n, [None, pa.py_buffer(values)],
                                      null_count=0)
        return [whole] if k == 1 else [whole.slice(j * n, n) for j in range(k)]
    bitmaps, nulls = _bitmaps(valid)
    return [pa.Array.from_buffers(type_, n, [bitmaps[j], pa.py_buffer(values[j])],
                                  null_count=nulls[j]) for j in range(k)]


def _request_words(nums: np.ndarray, ids: IdLookup) -> tuple[np.ndarray, list[str]]:
    """Codes of every row's request_id into a list of this drain's ids (-1: a negative or
    unknown number), one lookup per distinct number (no Python object per row)."""
    n = len(nums)
    if not n:
        return np.empty(0, dtype=np.int64), []
    lo, hi = int(nums.min()), int(nums.max())
    dense = hi - lo <= 4 * n + 4096
    if dense:
        # Request numbers come from a counter: a table over [lo, hi] instead of a sort.
        at = nums - lo
        seen = np.zeros(hi - lo + 1, dtype=bool)
        seen[at] = True
        distinct = (np.flatnonzero(seen) + lo).tolist()
    else:
        uniq, inverse = np.unique(nums, return_inverse=True)
        at = inverse.reshape(-1)
        distinct = uniq.tolist()
    words: list[str] = []
    codes: list[int] = []
    for u in distinct:
        rid = ids.get(u) if u >= 0 else None
        if rid is None:
            codes.append(-1)
        else:
            codes.append(len(words))
            words.append(rid)
    remap = np.array(codes, dtype=np.int64)
    if dense and len(distinct) != hi - lo + 1:  # gaps: indexed by number, not by rank
        full = np.full(hi - lo + 1, -1, dtype=np.int64)
        full[np.array(distinct, dtype=np.int64) - lo] = remap
        remap = full
    return remap[at], words



# The string and list<int64> columns built from buffers, not by `pa.array` on Python lists:
# `pa.array` probes a list with pandas' type checks and imports pandas (~0.4 s of CPU, tens of
# MiB) on the first drain of a process, on the pipeline thread of `kvscope run`, which has no
# other use for it. Anything these do not take as it is (a non-str word, a lone surrogate, a
# value outside int64) goes through `pa.array`, which accepts or refuses it as before.


def str_array(words: Sequence[Any]) -> pa.Array:
    """`pa.array(words, pa.string())` for a list of str, built from one UTF-8 buffer."""
    try:
        if any(type(w) is not str for w in words):
            raise TypeError
        enc = [w.encode("utf-8") for w in words]
    except (TypeError, UnicodeEncodeError):
        return pa.array(words, _STR)
    n = len(enc)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, enc), dtype=np.int64, count=n), out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        return pa.array(words, _STR)
    return pa.Array.from_buffers(_STR, n, [None, pa.py_buffer(offsets.astype(np.int32)),
                                           pa.py_buffer(b"".join(enc))], null_count=0)


def list_i64_array(values: Sequence[Sequence[int] | None]) -> pa.Array:
    """`pa.array(values, pa.list_(pa.int64()))` for lists (or tuples) of ints and Nones, built
    from an offsets, a validity and a values buffer."""
    n = len(values)
    try:
        lens = np.fromiter((0 if v is None else len(v) for v in values), dtype=np.int64,
                           count=n)
        items = list(chain.from_iterable(v for v in values if v is not None))
        if any(type(x) is not int for x in items):  # bools, floats, ...: pa.array's rules
            raise TypeError
        flat = np.array(items, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return pa.array(values, _LIST_I64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        return pa.array(values, _LIST_I64)
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=n)
    nulls = n - int(valid.sum())
    bitmap = None if not nulls else pa.py_buffer(np.packbits(valid, bitorder="little"))
    child = pa.Array.from_buffers(_I64, len(flat), [None, pa.py_buffer(flat)], null_count=0)
    return pa.Array.from_buffers(_LIST_I64, n, [bitmap, pa.py_buffer(offsets.astype(np.int32))],
                                 null_count=nulls, children=[child])


def request_ids(nums: np.ndarray, ids: IdLookup) -> pa.Array:
    """The request_id of every row (null for negative or unknown numbers): one lookup per
    distinct number, or per row when there are few rows."""
    if len(nums) <= 256:  # a few rows (a drain's layer rows): one lookup per row costs less
        return str_column(list(map(ids.get, nums.tolist())))
    codes, words = _request_words(nums, ids)
    return _decode(codes, str_array(words))


def _block(chunks: list[Chunk], ncols: int) -> np.ndarray:
    """The chunks' rows as one (rows, ncols) int64 matrix (a view for one row-major chunk)."""
    parts = [seg.rows(lo, hi) for seg, lo, hi in chunks]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


#: The rows of the drain's working matrix of the spans table: the string columns' codes first
#: (the request id's filled last), then the int64 columns, then the int32 ones, so that each
#: group is one slice.
_RID, _KIND, _NAME, _TIER, _CLOCK, _RN, _START, _END, _TOKENS, _BYTES, _STEP, _TRANSFER, \
    _LAYER, _BATCH, _BLOCKCOL = range(15)
_NROWS = 15
#: `kind` codes of the working matrix: state rows, activity buffer kinds (KIND_* + 1), steps.
_SPAN_KINDS = ("state", "activity", "ledger", "step")
#: Where an activity-buffer row's columns go (its column order: `Recorder._act`).
_ACT_TO = [_RN, _NAME, _START, _END, _TIER, _LAYER, _TOKENS, _BYTES, _TRANSFER, _CLOCK, _KIND,
           _BLOCKCOL]
#: Where a step span's columns go (step_id, name, start, end, batch, tokens, clock).
_STEP_TO = [_STEP, _NAME, _START, _END, _BATCH, _TOKENS, _CLOCK]


def spans_table(state: list[Chunk], act: list[Chunk], step: list[Chunk], steps: list[Chunk],
                ids: IdLookup, names: list[str], off: int) -> pa.Table:
    """The spans of one drain, in this order: request states (`state`), activity and ledger
    rows (`act`), then step spans: those of `engine_step` rows (`steps`, each expanded to its
    phases in `_STEP_ORDER`), then those recorded one by one (`step`)."""
    srows = _block(state, 4) if state else None
    arows = _block(act, len(_ACT_TO)) if act else None
    e = _block(steps, len(ENGINE_STEP_COLS)) if steps else None
    legacy = _block(step, len(_STEP_TO)) if step else None
    ns = 0 if srows is None else len(srows)
    na = 0 if arows is None else len(arows)
    phases = 0
    if e is not None:
        has_fwd = (e[:, 6] != -1) | (e[:, 7] != -1)
        phases = 4 if has_fwd.all() else 3 if not has_fwd.any() else -1
        nt = len(e) * phases if phases > 0 else len(e) * 3 + int(has_fwd.sum())
    else:
        nt = 0
    nl = 0 if legacy is None else len(legacy)
    n = ns + na + nt + nl
    cols = np.full((_NROWS, n), -1, dtype=np.int64)  # one row per column (column-major)
    if srows is not None:
        part = cols[:, :ns]
        part[_RN] = srows[:, 0]
        # State codes are STATES' indices; the names vocabulary starts with them.
        part[_NAME] = _state_names(tuple(names))[srows[:, 1]]
        part[_START:_END + 1] = srows[:, 2:4].T
        part[_KIND] = 0
        part[_CLOCK] = 0  # CLOCKS[0], "cpu"
    if arows is not None:
        part = cols[:, ns:ns + na]
        part[_ACT_TO] = arows.T
        part[_KIND] += 1
    if e is not None:
        part = cols[:, ns + na:ns + na + nt]
        codes = _phase_names(tuple(names))
        if phases > 0:  # every step has the same phases: per column a (steps, phases) view
            shape = (len(e), phases)
            part[_STEP].reshape(shape)[:] = e[:, 0:1]
            part[_NAME].reshape(shape)[:] = codes[:phases]
            part[_START].reshape(shape)[:] = e[:, _PHASE_START[:phases]]
            part[_END].reshape(shape)[:] = e[:, _PHASE_END[:phases]]
            part[_BATCH].reshape(shape)[:] = e[:, 8:9]
            part[_TOKENS].reshape(shape)[:] = e[:, 9:10]
        else:
            part[_STEP_TO] = _step_rows(steps, names).T
        part[_CLOCK] = 0  # CLOCK_CPU: resolved already
        part[_KIND] = 3
    if legacy is not None:
        part = cols[:, n - nl:]
        part[_STEP_TO] = legacy.T
        part[_KIND] = 3
    cols[_START:_END + 1] += off
    # The string columns, gathered at once from one vocabulary: request ids, kinds, span
    # names, tiers, clocks.
    rid, rid_words = _request_words(cols[_RN], ids)
    cols[_RID] = rid
    fixed = _fixed_words(tuple(names))
    vocab = str_array([*fixed, *rid_words])  # not valid UTF-8: raises, as before
    request_id, kind, name, tier, clock = _strings(
        cols[_RID:_CLOCK + 1],
        [len(fixed), 0, len(_SPAN_KINDS), len(_SPAN_KINDS) + len(names),
         len(_SPAN_KINDS) + len(names) + len(TIERS)], vocab)
    nums = cols[_RN:]
    valid = nums >= 0  # -1 (any negative) is null in every nullable column but step_id
    valid[_STEP - _RN, :ns + na] = False
    valid[_STEP - _RN, ns + na:] = True
    valid[_START - _RN:_END - _RN + 1] = True  # never null
    bitmaps, nulls = _bitmaps(valid)

    def ints(type_: pa.DataType, values: np.ndarray, j: int) -> pa.Array:
        return pa.Array.from_buffers(type_, n, [bitmaps[j - _RN], pa.py_buffer(values)],
                                     null_count=nulls[j - _RN])

    rn, start, end, tokens, nbytes, step_id, transfer = (
        ints(_I64, cols[j], j) for j in range(_RN, _TRANSFER + 1))
    i32 = cols[_LAYER:].astype(np.int32)
    layer, batch, block = (ints(_I32, i32[j - _LAYER], j) for j in range(_LAYER, _NROWS))
    waits = _waits_column(state, n) if state else None
    return pa.Table.from_arrays([
        request_id, rn, kind, name, start, end, tier, layer, tokens, nbytes, step_id, transfer,
        pa.nulls(n, _LIST_I64) if waits is None else waits,
        clock, batch, block], schema=SPANS_SCHEMA)


@lru_cache(maxsize=64)
def _state_names(names: tuple[str, ...]) -> np.ndarray:
    """State code → its name's code in `names`."""
    return np.array([names.index(s) for s in STATES], dtype=np.int64)


@lru_cache(maxsize=64)
def _phase_names(names: tuple[str, ...]) -> np.ndarray:
    """The codes of `_STEP_ORDER`'s phases in `names`."""
    return np.array([names.index(p) for p in _STEP_ORDER], dtype=np.int64)


def _waits_column(state: list[Chunk], n: int) -> pa.Array | None:
    """The spans' `waits_on` column (`n` rows, the state rows first): the sparse `waits` of
    the state chunks as list<int64>, null where a row has none; None when no row has any.
    The same array as `list_i64_array` of the padded list, with Python only for the rows
    that have waits (a few per drain), none per row."""
    pos: list[int] = []
    vals: list[tuple[int, ...]] = []
    base = 0
    for seg, lo, hi in state:
        if seg.waits:
            # A copy (one C call): the writer may insert rows beyond `hi` meanwhile.
            for i, w in sorted(seg.waits.copy().items()):
                if lo <= i < hi:
                    pos.append(base + i - lo)
                    vals.append(w)
        base += hi - lo
    if not pos:
        return None
    lens = np.zeros(n, dtype=np.int64)
    lens[pos] = list(map(len, vals))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    try:
        # `wait_for` stores exact ints (`operator.index`): checked within int64 in C here.
        if offsets[-1] > _I32_MAX or not all(type(x) is int for x in chain.from_iterable(vals)):
            raise TypeError
        flat = np.frombuffer(array("q", chain.from_iterable(vals)), dtype=np.int64)
    except (TypeError, OverflowError):
        padded: list[tuple[int, ...] | None] = [None] * n
        for p, w in zip(pos, vals, strict=True):
            padded[p] = w
        return list_i64_array(padded)  # what wait_for does not store: the general path
    valid = np.zeros(n, dtype=bool)
    valid[pos] = True
    child = pa.Array.from_buffers(_I64, len(flat), [None, pa.py_buffer(flat)], null_count=0)
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(_LIST_I64, n, [bitmap, pa.py_buffer(offsets.astype(np.int32))],
                                 null_count=n - len(pos), children=[child])


@lru_cache(maxsize=64)
def _fixed_words(names: tuple[str, ...]) -> tuple[str, ...]:
    """The spans' fixed words as `spans_table`'s vocabulary starts: kinds, span names, tiers,
    clocks."""
    return (*_SPAN_KINDS, *names, *TIERS, *CLOCKS)


#: The packed row of one engine step (`Recorder.engine_step`): its phase times, the forward's
#: (-1, -1: none, its span recorded apart), the batch, and the pools' occupancy (host -1: none).
ENGINE_STEP_COLS = ("step_id", "t0", "t1", "t2", "t3", "t4", "forward_start", "forward_end",
                    "batch_requests", "tokens", "device_in_use", "device_cached_free",
                    "device_empty", "host_in_use", "host_cached_free", "host_empty")
#: Phases of an engine step's spans, in the order they are recorded, with the packed row's
#: columns of their start and end.
_STEP_ORDER = ("schedule", "prepare", "sample", "forward")
_PHASE_START = [1, 2, 4, 6]
_PHASE_END = [2, 3, 5, 7]


def _step_rows(steps: list[Chunk], names: list[str]) -> np.ndarray:
    """`engine_step` rows expanded to their step spans: (rows, 7) as `_STEP_TO` orders them,
    step by step, phases in `_STEP_ORDER`, the forward only where the step has one."""
    e = _block(steps, len(ENGINE_STEP_COLS))
    n = len(e)
    x = np.empty((n, 4, 7), dtype=np.int64)
    x[:, :, 0] = e[:, 0:1]
    x[:, :, 1] = [names.index(p) for p in _STEP_ORDER]
    x[:, :, 2] = e[:, _PHASE_START]
    x[:, :, 3] = e[:, _PHASE_END]
    x[:, :, 4] = e[:, 8:9]
    x[:, :, 5] = e[:, 9:10]
    x[:, :, 6] = 0  # CLOCK_CPU: resolved already
    has_fwd = (e[:, 6] != -1) | (e[:, 7] != -1)
    if has_fwd.all():
        return x.reshape(n * 4, 7)
    keep = np.ones((n, 4), dtype=bool)
    keep[:, 3] = has_fwd
    return x[keep]


def layers_table(segs: list[Chunk], ids: IdLookup) -> pa.Table:
    cols = np.ascontiguousarray(_block(segs, len(LAYER_COLS)).T)
    return pa.Table.from_arrays(
        [request_ids(cols[0], ids), *_ints(_I32, cols[1:2].astype(np.int32)),
         *_ints(_I64, cols[2:])], schema=LAYERS_SCHEMA)


#: The requests table's columns before the accounting columns (`request_end`'s row: id, num,
#: tenant, class, arrival, first token, finish, status, the accounting, digest, output ids).
_REQ_HEAD = 8
_REQ_STRINGS = (0, 2, 3, 7)  # then the digest, after the accounting columns


def requests_table(rows: list[tuple[Any, ...]], off: int) -> pa.Table:
    n = len(rows)
    k = len(REQUESTS_SCHEMA) - _REQ_HEAD - 2  # the accounting columns: checked int64s
    # Per row its integers (request_num, arrival, finish, the accounting) packed in C (every
    # value checked as an int64), one row per column after the transpose; the first token
    # (None: null) apart.
    pack, get = _request_ints(k)
    ints = np.frombuffer(b"".join(starmap(pack, map(get, rows))), dtype=np.int64)
    ints = ints.reshape(n, 3 + k).T.copy()  # C order, writable
    ints[1:3] += off
    num, arrival, finish, *acct = _ints(_I64, ints)
    firsts = list(map(_FIRST, rows))
    if None in firsts:
        valid = np.fromiter(map(operator.is_not, firsts, repeat(None)), dtype=bool, count=n)
        first_ns = np.array([0 if f is None else f for f in firsts], dtype=np.int64) + off
        (first,) = _ints(_I64, first_ns.reshape(1, -1), valid.reshape(1, -1))
    else:
        first_ns = np.frombuffer(_request_firsts(n).pack(*firsts), dtype=np.int64) + off
        (first,) = _ints(_I64, first_ns.reshape(1, -1))
    # The string columns (strict UTF-8, as pa.array: a bad one fails the table): request id,
    # tenant, class, status, digest.
    # One array of the five columns one after the other, sliced.
    words = str_column([r[i] for i in (*_REQ_STRINGS, _REQ_HEAD + k) for r in rows])
    rid, tenant, wclass, status, digest = (words.slice(j * n, n) for j in range(5))
    ids = [r[-1] for r in rows]
    out_ids = (pa.nulls(n, _LIST_I64) if all(x is None for x in ids)
               else list_i64_array([None if x is None else x.tolist() for x in ids]))
    return pa.Table.from_arrays(
        [rid, num, tenant, wclass, arrival, first, finish, status, *acct, digest, out_ids],
        schema=REQUESTS_SCHEMA)


_FIRST = operator.itemgetter(5)


@lru_cache(maxsize=8)
def _request_ints(k: int) -> tuple[Any, Any]:
    """(pack, get): a request row's integers but its first token (`get`) as int64s."""
    return (struct.Struct(f"{3 + k}q").pack,
            operator.itemgetter(1, 4, 6, *range(_REQ_HEAD, _REQ_HEAD + k)))


@lru_cache(maxsize=64)
def _request_firsts(n: int) -> struct.Struct:
    return struct.Struct(f"{n}q")


def str_column(values: Sequence[Any]) -> pa.Array:
    """`pa.array(values, pa.string())` for str and None values (strict UTF-8: a lone
    surrogate fails as it fails there), each distinct value encoded once; anything else goes
    through `pa.array`, which accepts or refuses it as before."""
    n = len(values)
    try:
        distinct = dict.fromkeys(values)
        if not all(v is None or type(v) is str for v in distinct):
            raise TypeError
        enc = {v: b"" if v is None else v.encode("utf-8") for v in distinct}
    except (TypeError, UnicodeEncodeError):
        return pa.array(values, _STR)
    words = list(map(enc.__getitem__, values))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, words), dtype=np.int64, count=n), out=offsets[1:])
    if offsets[-1] > _I32_MAX:
        return pa.array(values, _STR)
    bitmap, nulls = _validity(values, n) if None in enc else (None, 0)
    return pa.Array.from_buffers(_STR, n, [bitmap, pa.py_buffer(offsets.astype(np.int32)),
                                           pa.py_buffer(b"".join(words))], null_count=nulls)


# NOTE: the samples and events columns are built from buffers. `pa.array()` probes its input with
# pandas' type checks and imports pandas when it is installed (~0.5 s and tens of MiB); the node
# agent must stay free of it, and building the buffers directly costs less anyway.


def _validity(values: Sequence[Any], n: int) -> tuple[pa.Buffer, int]:
    """The validity bitmap of `values` (None is null) and its null count."""
    valid = np.fromiter(map(operator.is_not, values, repeat(None)), dtype=bool, count=n)
    return pa.py_buffer(np.packbits(valid, bitorder="little")), n - int(valid.sum())


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
    bitmap, nulls = _validity(values, n) if None in codes else (None, 0)
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


def _coded(values: Sequence[Any], words: list[str]) -> np.ndarray:
    """Codes of `values` (str or None) into `words`, extended in place with the values not in
    it yet (None: -1); each distinct value is looked up once, the rows by C-level `map`."""
    index: dict[Any, int] = {w: i for i, w in enumerate(words)}
    index[None] = -1
    for v in dict.fromkeys(values):
        if v not in index:
            index[v] = len(words)
            words.append(v)
    return np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values))


def _utf8(word: Any) -> str:
    """A sample's string as `_string` writes it (a lone surrogate becomes '?')."""
    return (word if type(word) is str else str(word)).encode("utf-8", "replace").decode()


@lru_cache(maxsize=64)
def _sample_vocab(words: tuple[str, ...]) -> pa.Array:
    """The string array of a samples table's words (mostly the same few from drain to
    drain)."""
    return str_array([_utf8(w) for w in words])


#: The pool samples of one `engine_step` row: (entity, metric) codes of its six counts.
_POOL_ENTITY = np.array([0, 0, 0, 1, 1, 1], dtype=np.int64)
_POOL_METRIC = np.array([0, 1, 2, 0, 1, 2], dtype=np.int64)


def engine_samples_table(steps: list[Chunk], rows: Sequence[tuple[Any, ...]], off: int
                         ) -> pa.Table:
    """The `samples` table of `engine_step` rows (`steps`: per step its device pool's three
    states, then the host tier's, at the step's t4) merged with sample rows recorded one by
    one (`rows`, as `samples_table`) in the order they were recorded: a row recorded at t
    follows every step sample at or before t (the rows' own order is kept)."""
    if not steps:
        return samples_table(rows, off)
    e = _block(steps, len(ENGINE_STEP_COLS))
    n = len(e)
    counts = e[:, 10:16]
    has_host = e[:, 13] != -1
    all_host = bool(has_host.all())
    m = 6 * n if all_host else 3 * (n + int(has_host.sum()))
    k = len(rows)
    # One working matrix: ts, then the codes of source, entity, metric and unit into one
    # vocabulary (`words`: the step samples' words first).
    w = np.zeros((5, m + k), dtype=np.int64)
    if all_host:
        w[0, :m] = np.repeat(e[:, 5], 6)
        w[2, :m].reshape(n, 6)[:] = _POOL_ENTITY + 1  # "device", "host"
        w[3, :m].reshape(n, 6)[:] = _POOL_METRIC + 3  # BLOCK_STATES
        value = np.empty(m + k, dtype=np.float64)
        value[:m] = counts.ravel()
    else:
        keep = np.ones((n, 6), dtype=bool)
        keep[:, 3:] = has_host[:, None]
        w[0, :m] = np.repeat(e[:, 5], keep.sum(axis=1))
        w[2, :m] = np.broadcast_to(_POOL_ENTITY + 1, (n, 6))[keep]
        w[3, :m] = np.broadcast_to(_POOL_METRIC + 3, (n, 6))[keep]
        value = np.empty(m + k, dtype=np.float64)
        value[:m] = counts[keep]
    words: list[Any] = ["pool", "device", "host", *BLOCK_STATES, "blocks"]
    w[4, :m] = len(words) - 1  # "blocks"; source 0: "pool"
    if k:
        rts, rsrc, rent, rmet, rval, runit = zip(*rows, strict=True)
        w[0, m:] = np.fromiter(rts, dtype=np.int64, count=k)
        index: dict[Any, int] = {v: i for i, v in enumerate(words)}
        index[None] = -1
        for j, col in enumerate((rsrc, rent, rmet, runit), start=1):
            for v in dict.fromkeys(col):
                if v not in index:
                    index[v] = len(words)
                    words.append(v)
            w[j, m:] = np.fromiter(map(index.__getitem__, col), dtype=np.int64, count=k)
        value[m:] = np.fromiter(rval, dtype=np.float64, count=k)
        keys = np.concatenate([w[0, :m], np.maximum.accumulate(w[0, m:])])
        if not (keys[1:] >= keys[:-1]).all():
            order = np.argsort(keys, kind="stable")
            w = w.take(order, axis=1)  # C-contiguous (a fancy index may not be)
            value = value[order]
    w[0] += off
    src, ent, met, uni = _strings(w[1:], [0, 0, 0, 0], _sample_vocab(tuple(words)))
    return pa.Table.from_arrays(
        [*_ints(_I64, w[:1]), src, ent, met, *_ints(_F64, value.reshape(1, -1)), uni],
        schema=SAMPLES_SCHEMA)


# What json.dumps(detail, default=str, sort_keys=True) and json.dumps(detail, default=str)
# call, with their encoders built once rather than per event.
_JSON_SORTED = json.JSONEncoder(default=str, sort_keys=True).encode
_JSON = json.JSONEncoder(default=str).encode


#: detail_json's results for details of str keys and int / str / bool / None values (the
#: engine's events: an eviction's {"tier": ..., "blocks": n} repeats a few values all run),
#: keyed by the items and the types of keys and values (1, 1.0 and True are one dict key, and
#: their JSON differs; floats are never cached: 0.0 and -0.0 are equal, NaN equals nothing).
_DETAIL_CACHE: dict[tuple[Any, ...], str] = {}
_DETAIL_CACHE_MAX = 4096
_CACHED_TYPES = frozenset((int, str, bool, type(None)))


def detail_json(detail: dict[str, Any] | None) -> str | None:
    """An event's detail as JSON text, keys sorted when they can be; never raises (the drain
    must not fail on one value)."""
    if detail is None:
        return None
    try:
        # One C-level pass each: the items (hashable when the values are of the cached
        # types) and the types of every key and value.
        key = (tuple(detail.items()), tuple(map(type, chain(detail, detail.values()))))
        hit = _DETAIL_CACHE.get(key)
    except Exception:  # an unhashable value (a list, a dict), or not a dict at all
        key = None
    else:
        if hit is not None:
            return hit
        if _CACHED_TYPES.issuperset(key[1]):
            text = _detail_json(detail)
            if len(_DETAIL_CACHE) >= _DETAIL_CACHE_MAX:
                _DETAIL_CACHE.clear()
            _DETAIL_CACHE[key] = text
            return text
    return _detail_json(detail)


def _detail_json(detail: dict[str, Any]) -> str:
    """`detail_json` of a dict, uncached."""
    try:
        return _JSON_SORTED(detail)
    except TypeError:  # keys of mixed types cannot be sorted
        pass
    except Exception as exc:  # circular references, a failing __str__, ...
        return json.dumps({"unserializable": type(exc).__name__, "repr": _safe_repr(detail)})
    try:
        return _JSON(detail)
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
