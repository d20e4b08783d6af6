"""The per-request TTFT partition (docs/DESIGN.md, "TTFT stages") and its aggregates.

`partition` turns a run's ``requests`` and ``spans`` frames into one row per request whose
``<stage>_ns`` columns sum exactly to ``ttft_ns``. Requests recorded with state spans take their
stages from them; requests that only have overlapping activity spans (imported traces) are split
by the sweep-line priority ``prefill > sync > h2d > queue > remote_read > lookup > other`` and
marked ``derived``. Data that breaks the partition (gaps, overlaps, spans outside the request) is
never silently trusted: the request is resolved by the same sweep line and named in ``violation``.

`summarize` aggregates a partition: percentiles and shares per stage, what the slowest requests
spent their time on, and percentiles over time windows, optionally per tenant, workload class or
hit class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from agent.errors import InputError
from agent.intervals import (
    STAGE_RANK,
    clip_to_window,
    nested_union_lengths,
    priority_partition,
)
from agent.schema import TTFT_STAGES
from analyzers import frames as F

# The summaries live in their own module; re-exported here as part of the ttft API.
from analyzers.ttft_summary import (
    TTFTSummary,
    build_frame,
    column_array,
    int_column,
    summarize,
    valid_column,
)

if TYPE_CHECKING:
    import pandas as pd
else:  # imported on a thread while the caller reads (see `analyzers.frames`)
    pd = F.PANDAS

__all__ = [
    "ACTIVITY_STAGES",
    "HIT_CLASSES",
    "LOAD_ACTIVITIES",
    "PARTITION_SPAN_COLUMNS",
    "PARTITION_SPAN_KINDS",
    "STAGE_COLUMNS",
    "PartitionError",
    "TTFTSummary",
    "partition",
    "request_rows_by_num",
    "summarize",
    "violations",
]

STAGE_COLUMNS = F.STAGE_COLUMNS
#: Activity span names that stand for a stage when a request has no state spans (importers map
#: ``kvscope.<stage>`` ranges to the bare stage name). A prefetch is remote-tier reading.
ACTIVITY_STAGES: Mapping[str, str] = {**{s: s for s in TTFT_STAGES}, "prefetch": "remote_read"}
#: Activity span names that move KV towards the device: their overlap with queue time is the
#: request's hidden load time.
LOAD_ACTIVITIES: tuple[str, ...] = ("remote_read", "prefetch", "h2d", "host_read")
#: The span columns `partition` reads, and the span kinds it reads (the others are ignored):
#: open a run with ``open_run(..., columns={"spans": PARTITION_SPAN_COLUMNS}, filters={"spans":
#: [("kind", "in", list(PARTITION_SPAN_KINDS))]})`` to read only what the partition needs; its
#: result is the same as over the whole spans table. Without ``request_id``, spans are matched
#: to requests by the int64 ``request_num`` (the run store writes both for every span).
PARTITION_SPAN_COLUMNS: tuple[str, ...] = ("request_num", "kind", "name", "start_ns", "end_ns")
PARTITION_SPAN_KINDS: tuple[str, ...] = ("state", "activity")
#: Hit classes of a request, from its accounting: nothing reused, some, or every lookup token.
HIT_CLASSES: tuple[str, ...] = ("cold", "partial", "full")

_K = len(TTFT_STAGES)
_QUEUE = TTFT_STAGES.index("queue")
_REQUIRED_REQUESTS = ("request_id", "arrival_ns", "first_token_ns")
_REQUIRED_SPANS = ("kind", "name", "start_ns", "end_ns")


class PartitionError(RuntimeError):
    """An internal invariant of the partition failed (a bug in kvscope, not bad input)."""


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-spread 64-bit hash of each int64 (wrapping arithmetic)."""
    z = x.astype(np.uint64)  # a copy, then every step in place
    z += np.uint64(0x9E3779B97F4A7C15)
    t = z >> np.uint64(30)
    z ^= t
    z *= np.uint64(0xBF58476D1CE4E5B9)
    np.right_shift(z, np.uint64(27), out=t)
    z ^= t
    z *= np.uint64(0x94D049BB133111EB)
    np.right_shift(z, np.uint64(31), out=t)
    z ^= t
    return z


def _tiles(r: np.ndarray, start: np.ndarray, end: np.ndarray, arrival: np.ndarray,
           first: np.ndarray, n: int, a_r: np.ndarray, f_r: np.ndarray, dur: np.ndarray,
           total: np.ndarray) -> np.ndarray:
    """Per request: do its spans tile ``[arrival, first]`` exactly (no gap, overlap, overhang)?

    Without sorting: spans with ``start <= end`` tile the window iff the multiset of their
    starts plus ``first`` equals the multiset of their ends plus ``arrival`` (then exactly one
    span covers every instant). Multisets are compared through sums of a 64-bit hash together
    with the exact sum of durations; a false "tiles" needs a 64-bit hash collision on data that
    also has the right total (probability ~2^-64 per request). Zero-length spans cancel out of
    both multisets, so each span must also lie inside the window (one at -1 ns of a request
    with TTFT 0 would otherwise "tile" it). `a_r`, `f_r`, `dur` and `total` are ``arrival[r]``,
    ``first[r]``, ``end - start`` and the int64 sums of `dur` per request, which the caller
    has at hand.
    """
    out = (dur < 0) | (start < a_r) | (end > f_r)
    ok = np.ones(n, dtype=bool)
    if out.any():
        ok[r[out]] = False
    m = len(r)
    if not m:
        return ok & (total == first - arrival) & (first == arrival)
    # Most requests' spans come as one chain (a run store writes them so): consecutive rows of
    # the request, each starting where the one before ended. The multisets of such a chain are
    # equal exactly when it starts at arrival and ends at the first token, which is compared
    # directly; only the other requests' spans are hashed (the same answer: mix64 is a
    # bijection, and an unchained request's multisets are compared as before).
    new_req = r[1:] != r[:-1]
    head = np.flatnonzero(np.concatenate(([True], new_req)))  # each run of one request
    run_r = r.take(head)
    chained = np.bincount(run_r, minlength=n) == 1  # the request's spans are one run
    unlinked = ~new_req & (start[1:] != end[:-1])
    if unlinked.any():
        chained[r[1:][unlinked]] = False
    tail = np.empty(len(head), dtype=np.intp)
    tail[:-1] = head[1:] - 1
    tail[-1] = m - 1
    same = np.zeros(n, dtype=bool)
    same[run_r] = (start.take(head) == a_r.take(head)) & (end.take(tail) == f_r.take(tail))
    has = np.zeros(n, dtype=bool)
    has[run_r] = True
    rest = has & ~chained  # requests with spans, not one chain: their multisets hashed
    if rest.any():
        sel = np.flatnonzero(rest.take(r))
        with np.errstate(over="ignore"):
            h = np.zeros(n, dtype=np.uint64)  # sum of hash(start) - hash(end), mod 2^64
            np.add.at(h, r.take(sel), _mix64(start.take(sel)) - _mix64(end.take(sel)))
            ids = np.flatnonzero(rest)
            same[ids] = (h.take(ids) + _mix64(first.take(ids)) - _mix64(arrival.take(ids))
                         == 0)
    # (requests without spans: the multisets are {first} and {arrival})
    none = ~has
    if none.any():
        same[none] = first[none] == arrival[none]
    return ok & (total == first - arrival) & same


def _flag_text(flags: Mapping[str, np.ndarray], n: int) -> np.ndarray | None:
    """Comma-joined names of the flags set per row (None where none is set; None for all
    when no row has one)."""
    any_set = np.zeros(n, dtype=bool)
    for m in flags.values():
        any_set |= m
    rows = np.flatnonzero(any_set)  # rare: only rows with a violation are formatted
    if not len(rows):
        return None
    out = np.full(n, None, dtype=object)
    names = np.array(list(flags))
    mat = np.column_stack([flags[k][rows] for k in flags])
    out[rows] = [",".join(names[row]) for row in mat]
    return out


@cache
def _hit_dtype() -> pd.CategoricalDtype:
    """The hit classes' categorical dtype (made once, at the first use: pandas is imported on
    a thread while this module loads)."""
    return pd.CategoricalDtype(list(HIT_CLASSES))


def _hit_class(requests: pd.DataFrame) -> pd.Categorical:
    """cold / partial / full from the accounting; null where the input lacks the counts."""
    n = len(requests)
    need = ("device_hit_tokens", "host_loaded_tokens", "remote_loaded_tokens", "lookup_tokens")
    given = [c for c in need if c in requests]
    known: np.ndarray | None = None  # None: every count known
    if len(given) < len(need):
        known = np.zeros(n, dtype=bool)
    for c in given:
        a = column_array(requests, c)
        if not (isinstance(a, np.ndarray) and a.dtype.kind in "iub"):  # may hold nulls
            v = valid_column(requests, c)
            known = v if known is None else known & v

    def col(c: str) -> np.ndarray:
        return int_column(requests, c, 0) if c in given else np.zeros(n, np.int64)

    reused = col("device_hit_tokens") + col("host_loaded_tokens") + col("remote_loaded_tokens")
    lookup = col("lookup_tokens")
    code = np.where(reused <= 0, 0, np.where((lookup > 0) & (reused >= lookup), 2, 1))
    # Codes -1..2 by construction: no validation pass (the same categorical).
    return pd.Categorical.from_codes(code if known is None else np.where(known, code, -1),
                                     dtype=_hit_dtype(), validate=False)


def partition(
    requests: pd.DataFrame,
    spans: pd.DataFrame,
    *,
    activity_stages: Mapping[str, str] = ACTIVITY_STAGES,
    load_activities: Sequence[str] = LOAD_ACTIVITIES,
) -> pd.DataFrame:
    """The TTFT partition: one row per request, in the order of `requests`.

    Args:
        requests: the run store's ``requests`` frame (``request_id, arrival_ns,
            first_token_ns`` required; ``finish_ns, status, tenant, workload_class,
            output_tokens`` and the accounting columns used when present).
        spans: the ``spans`` frame (``request_id, kind, name, start_ns, end_ns``); without
            ``request_id`` but with ``request_num`` (in both frames), spans are matched to
            requests by the int64 ``request_num`` instead of the string id. Only the rows of
            `PARTITION_SPAN_KINDS` are read.
        activity_stages: activity name → stage, for requests without state spans.
        load_activities: activity names whose overlap with queue time is hidden load time.

    Returns:
        DataFrame with ``request_id, tenant, workload_class, hit_class, status, arrival_ns,
        first_token_ns``, one ``<stage>_ns`` column per TTFT stage, ``ttft_ns``,
        ``hidden_load_ns`` (load activity of the request overlapping its queue time),
        ``itl_ns`` (mean inter-token latency, float), ``e2e_ns``, ``derived`` (stages from
        the activity sweep line, not state spans) and ``violation`` (comma-separated: ``gap``,
        ``overlap``, ``outside``, ``negative``, ``no_spans``, ``first_token_before_arrival``;
        null when clean). Integer columns are ``Int64``; they are null for a request without a
        first token, whose TTFT is undefined.

    Raises:
        InputError: missing columns, duplicate request ids (or request_nums, when matching
            by them).
        PartitionError: the stages of some request do not sum to its TTFT (a kvscope bug).
    """
    F.require_columns(requests, _REQUIRED_REQUESTS, "requests")
    by_num = "request_id" not in spans and "request_num" in spans and "request_num" in requests
    F.require_columns(spans, _REQUIRED_SPANS if by_num else ("request_id", *_REQUIRED_SPANS),
                      "spans")
    F.require_unique_ids(requests)
    n = len(requests)
    # Every column read once, through its array (`column_array`: no Series built). The
    # arrays may be the frames' own buffers: nothing below writes into them.
    arrival = int_column(requests, "arrival_ns")
    first = int_column(requests, "first_token_ns")
    has_ft = valid_column(requests, "first_token_ns")
    bad_first = has_ft & (first < arrival)
    has_ft = has_ft & ~bad_first
    ttft = np.where(has_ft, first - arrival, 0)

    # Only attributed state and activity spans of requests with a first token can matter. Rows
    # of other kinds matter nowhere, and a row that is not a state span only as a load or as an
    # activity stage of a derived request: only those few rows' kinds are compared with
    # "activity" (`_equals_at`, where they are selected below), not every row's.
    ridx, matched = (request_rows_by_num(spans, requests) if by_num
                     else (F.request_index(spans["request_id"], requests["request_id"]), False))
    kind = _strings(spans, "kind")
    is_state_kind = _equals_arrow(kind, "state")
    valid: np.ndarray | None = None  # rows whose request is known and has a first token
    if not matched:  # (`matched`: every span's request is known, no test needed)
        valid = ridx >= 0
    if not has_ft.all():
        if valid is None:
            valid = np.ones(len(ridx), dtype=bool)
        valid[valid] = has_ft[ridx[valid]]
    # Span names matter only as members of the few names the partition knows: each row's
    # index in that vocabulary (-1: any other name, or null), by one hash look-up a row.
    vocab = list(dict.fromkeys([*TTFT_STAGES, *activity_stages, *load_activities]))
    code = _vocab_index_arrow(_strings(spans, "name"), vocab)
    start = int_column(spans, "start_ns", 0)
    end = int_column(spans, "end_ns", 0)

    # ---- state spans: the recorded partition
    # `vocab` opens with `TTFT_STAGES` in order: a name's stage is its code where the code is
    # below `_K` (one unsigned compare: -1 wraps above it), and no stage elsewhere.
    # A state span belongs to TTFT when it starts before the first token (a zero-length span at
    # arrival too, so that a request with TTFT 0 still counts as recorded).
    stated = is_state_kind & (code.view(np.uint64) < _K)
    if valid is not None:
        stated &= valid
    si = np.flatnonzero(stated)
    # (`take`: numpy's gather without fancy indexing's overhead, a third faster here)
    sr, s_start = ridx.take(si), start.take(si)
    a_r, f_r = arrival.take(sr), first.take(sr)
    inside = (s_start < f_r) | (s_start == a_r)
    if not inside.all():
        si, sr, s_start = si[inside], sr[inside], s_start[inside]
        a_r, f_r = a_r[inside], f_r[inside]
    s_end, s_stage = end.take(si), code.take(si)
    s_dur = s_end - s_start
    has_state = np.bincount(sr, minlength=n) > 0
    # Every state span's time into its request's stage: the recorded partition of the requests
    # whose spans tile, and (int64, wrapping) each request's total span time; the rows of the
    # others are overwritten by their repair below.
    stage_ns = np.zeros((n, _K), dtype=np.int64)
    np.add.at(stage_ns.reshape(-1), sr * _K + s_stage, s_dur)
    tiles = has_state & _tiles(sr, s_start, s_end, arrival, first, n, a_r, f_r, s_dur,
                               stage_ns.sum(axis=1))

    flags: dict[str, np.ndarray] = {}
    broken = has_state & ~tiles
    if broken.any():
        flags.update(_resolve_broken(broken, sr, s_start, s_end, s_stage, arrival, first, ttft,
                                     stage_ns))

    # ---- activity-only requests: the derived partition
    derived = has_ft & ~has_state
    act_table = _vocab_table(vocab, {a: TTFT_STAGES.index(s) for a, s in activity_stages.items()})
    is_act = ~is_state_kind  # an activity span where its kind says so (`_equals_at`)
    if valid is not None:
        is_act &= valid
    if derived.any():
        ui = np.flatnonzero(is_act & (act_table[code] >= 0))
        ui = ui[derived[ridx[ui]]]
        ui = _activity_rows(kind, ui)
    else:
        ui = np.zeros(0, dtype=np.intp)
    acts = _Sel(ridx[ui], start[ui], end[ui], act_table[code[ui]])
    covered = np.zeros(n, dtype=bool)
    if derived.any():
        covered = _derive(derived, acts.r, acts.start, acts.end, acts.stage, arrival, ttft,
                          stage_ns)
    flags["no_spans"] = derived & ~covered & (ttft > 0)
    flags["first_token_before_arrival"] = bad_first

    # ---- hidden load time: the request's own loads overlapping its queue time
    is_load = _vocab_table(vocab, dict.fromkeys(load_activities, 1)) > 0  # per code, bool
    li = _activity_rows(kind, np.flatnonzero(is_act & is_load.take(code)))
    hidden = _hidden_load(
        _Sel(ridx.take(li), start.take(li), end.take(li), act_table.take(code.take(li))),
        _Sel(sr, s_start, s_end, s_stage),
        acts,
        has_state, tiles, derived, arrival, ttft, stage_ns,
    )

    by_stage = np.ascontiguousarray(stage_ns.T)  # a row per stage: contiguous columns
    sums = by_stage.sum(axis=0)
    wrong = has_ft & (sums != ttft)
    if wrong.any():
        ids = requests["request_id"].to_numpy()[wrong][:5]
        raise PartitionError("stages do not sum to ttft_ns for request(s) "
                             f"{', '.join(map(str, ids))}")
    return _frame(requests, by_stage, ttft, hidden, has_ft, derived, _flag_text(flags, n))


def _vocab_table(vocab: list[str], mapping: Mapping[str, int]) -> np.ndarray:
    """`mapping` over `_vocab_index` codes: ``table[code]`` is the value of the code's name
    (-1 where `mapping` lacks it, and at index -1, for names outside `vocab`)."""
    return np.array([mapping.get(v, -1) for v in vocab] + [-1], dtype=np.int64)


def _strings(df: pd.DataFrame, name: str) -> pa.Array | pa.ChunkedArray:
    """`analyzers.frames.arrow_strings` of ``df[name]``, from the column's array (no Series
    built) when it is an extension array (a run store's Arrow-backed strings: zero-copy)."""
    a = column_array(df, name)
    if isinstance(a, np.ndarray) or not len(a):
        return F.arrow_strings(df[name])
    arr = pa.array(a)
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = arr.cast(pa.large_string())
    return arr


def _vocab_index(col: pd.Series, vocab: list[str]) -> np.ndarray:
    """Index of each entry of a string column in `vocab` (-1: not in it, or null)."""
    return _vocab_index_arrow(F.arrow_strings(col), vocab)


def _vocab_index_arrow(arr: pa.Array | pa.ChunkedArray, vocab: list[str]) -> np.ndarray:
    """`_vocab_index` of the column's Arrow strings."""
    idx = pc.index_in(arr, value_set=pa.array(vocab, type=arr.type))
    out = np.empty(len(arr), dtype=np.int64)
    at = 0
    for c in (idx.chunks if isinstance(idx, pa.ChunkedArray) else [idx]):
        n = len(c)
        if not n:
            continue
        out[at:at + n] = np.frombuffer(c.buffers()[1], dtype=np.int32, count=c.offset + n
                                       )[c.offset:]
        if c.null_count:
            out[at:at + n][~_bits(c.buffers()[0], c.offset, n)] = -1
        at += n
    return out


def _bits(buf: pa.Buffer, offset: int, n: int) -> np.ndarray:
    """Bits ``offset .. offset + n`` of an Arrow bitmap as a (writable) numpy bool array."""
    return np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little",
                         count=offset + n)[offset:].view(np.bool_)


def _equals(col: pd.Series, value: str) -> np.ndarray:
    """`analyzers.frames.equals` (rows of a string column equal to `value`; null rows:
    False), its Arrow result unpacked straight from the bitmaps."""
    return _equals_arrow(F.arrow_strings(col), value)


def _equals_arrow(arr: pa.Array | pa.ChunkedArray, value: str) -> np.ndarray:
    """`_equals` of the column's Arrow strings."""
    eq = pc.equal(arr, pa.scalar(value, arr.type))
    parts = []
    for c in (eq.chunks if isinstance(eq, pa.ChunkedArray) else [eq]):
        if not len(c):
            continue
        bits = _bits(c.buffers()[1], c.offset, len(c))
        if c.null_count:
            bits &= _bits(c.buffers()[0], c.offset, len(c))
        parts.append(bits)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def _activity_rows(kind: pa.Array | pa.ChunkedArray, rows: np.ndarray) -> np.ndarray:
    """Those of `rows` whose `kind` is ``activity`` (`_equals` of only those rows' kinds)."""
    if not len(rows):
        return rows
    ok = _equals_arrow(kind.take(pa.array(rows, type=pa.int64())), "activity")
    return rows if ok.all() else rows[ok]


def request_rows_by_num(spans: pd.DataFrame, requests: pd.DataFrame
                        ) -> tuple[np.ndarray, bool]:
    """Row of `requests` that each span's request_num names (-1: null or unknown): an
    int64 join, through a dense lookup table when the numbers are compact (a run's are
    0..n-1), else a binary search. With it, whether every span names a known request (no
    -1; False: not known).

    Raises:
        InputError: a request without a request_num, or two with the same.
    """
    if not valid_column(requests, "request_num").all():
        raise InputError("requests: request_num missing for some request (spans without "
                         "request_id are matched to requests by it)")
    rn = int_column(requests, "request_num")
    sn = int_column(spans, "request_num", 0)
    ok = valid_column(spans, "request_num")
    if not len(rn):
        return np.full(len(sn), -1, dtype=np.int64), False
    lo, hi = int(rn.min()), int(rn.max())
    if hi - lo < 8 * len(rn) + 1024:  # dense: one gather per span
        count = np.bincount(rn - lo if lo else rn, minlength=hi - lo + 1)
        if count.max() > 1:
            _duplicate_nums(np.flatnonzero(count > 1) + lo)
        lut = np.full(hi - lo + 1, -1, dtype=np.int64)
        lut[rn - lo if lo else rn] = np.arange(len(rn))
        if len(sn) and ok.all() and int(sn.min()) >= lo and int(sn.max()) <= hi:
            # Every span names a number in range (a run's do); when the requests' numbers
            # fill the range (unique, as counted), each of those is a request's.
            # (indexing, not `take`: numpy's take copies a read-only index array, as the
            # frame's column is, by a slow path, about 9x the gather itself)
            return lut[sn - lo if lo else sn], hi - lo + 1 == len(rn)
        out = np.full(len(sn), -1, dtype=np.int64)
        inside = ok & (sn >= lo) & (sn <= hi)
        out[inside] = lut[sn[inside] - lo]
        return out, False
    order = np.argsort(rn, kind="stable")
    srt = rn[order]
    if (srt[1:] == srt[:-1]).any():
        _duplicate_nums(srt[1:][srt[1:] == srt[:-1]])
    out = np.full(len(sn), -1, dtype=np.int64)
    pos = np.minimum(np.searchsorted(srt, sn), len(srt) - 1)
    hit = ok & (srt[pos] == sn)
    out[hit] = order[pos[hit]]
    return out, False


def _duplicate_nums(dups: np.ndarray) -> None:
    dup = sorted(set(dups.tolist()))[:5]
    raise InputError(f"requests: duplicate request_num(s) {', '.join(map(str, dup))}")


def _resolve_broken(broken: np.ndarray, sr: np.ndarray, s_start: np.ndarray, s_end: np.ndarray,
                    s_stage: np.ndarray, arrival: np.ndarray, first: np.ndarray,
                    ttft: np.ndarray, stage_ns: np.ndarray) -> dict[str, np.ndarray]:
    """Re-partition requests whose state spans do not tile TTFT; return what was wrong."""
    n = len(broken)
    ids = np.flatnonzero(broken)
    compact = np.full(n, -1, dtype=np.int64)
    compact[ids] = np.arange(len(ids))
    sel = broken[sr]
    g = compact[sr[sel]]
    st, en, stg = s_start[sel], s_end[sel], s_stage[sel]
    negative = np.zeros(n, dtype=bool)
    negative[sr[sel][en < st]] = True
    outside = np.zeros(n, dtype=bool)
    outside[sr[sel][(st < arrival[sr[sel]]) | (en > first[sr[sel]])]] = True
    cs, ce = clip_to_window(g, st, en, arrival[ids], first[ids])
    part, union = priority_partition(g, cs, ce, stg, arrival[ids], ttft[ids])
    stage_ns[ids] = part
    total = np.zeros(len(ids), dtype=np.int64)
    np.add.at(total, g, ce - cs)
    gap = np.zeros(n, dtype=bool)
    gap[ids] = union < ttft[ids]
    overlap = np.zeros(n, dtype=bool)
    overlap[ids] = total > union
    return {"gap": gap, "overlap": overlap, "outside": outside, "negative": negative}


def _derive(derived: np.ndarray, r: np.ndarray, start: np.ndarray, end: np.ndarray,
            stage: np.ndarray, arrival: np.ndarray, ttft: np.ndarray,
            stage_ns: np.ndarray) -> np.ndarray:
    """Sweep-line partition of activity-only requests into `stage_ns`; returns which requests
    had any activity span inside their TTFT window."""
    ids = np.flatnonzero(derived)
    compact = np.full(len(derived), -1, dtype=np.int64)
    compact[ids] = np.arange(len(ids))
    g = compact[r]
    cs, ce = clip_to_window(g, start, end, arrival[ids], arrival[ids] + ttft[ids])
    part, union = priority_partition(g, cs, ce, stage, arrival[ids], ttft[ids])
    stage_ns[ids] = part
    covered = np.zeros(len(derived), dtype=bool)
    covered[ids] = union > 0
    return covered


@dataclass(slots=True, frozen=True)
class _Sel:
    """A selection of spans: request row, bounds and `TTFT_STAGES` index (-1 when none)."""

    r: np.ndarray
    start: np.ndarray
    end: np.ndarray
    stage: np.ndarray

    def where(self, mask: np.ndarray) -> _Sel:
        """The spans where `mask` holds (this selection itself when it holds for all)."""
        if np.count_nonzero(mask) == len(mask):
            return self
        idx = np.flatnonzero(mask)  # one scan of the mask, then four gathers
        return _Sel(self.r.take(idx), self.start.take(idx), self.end.take(idx),
                    self.stage.take(idx))


def _hidden_load(loads: _Sel, states: _Sel, acts: _Sel, has_state: np.ndarray,
                 tiles: np.ndarray, derived: np.ndarray, arrival: np.ndarray, ttft: np.ndarray,
                 stage_ns: np.ndarray) -> np.ndarray:
    """Time each request's own load activity (L) overlaps its queue time (Q).

    Recorded partitions: queue spans are disjoint, so |Q ∩ L| = |Q| + |L| - |Q ∪ L| with
    |Q| = queue_ns. Otherwise (derived or repaired requests) Q is where ``queue`` owns the
    sweep line: |Q ∩ L| = |P<=queue ∩ L| - |P<queue ∩ L| (P<=k: spans ranked at or above k),
    and |P ∩ L| = |P| + |L| - |P ∪ L| again.
    """
    n = len(tiles)
    hidden = np.zeros(n, dtype=np.int64)
    origin, stop = arrival, arrival + ttft

    def compact_ids(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mask = np.zeros(n, dtype=bool)
        mask[rows] = True
        ids = np.flatnonzero(mask)
        compact = np.full(n, -1, dtype=np.int64)
        compact[ids] = np.arange(len(ids))
        return ids, compact

    # Recorded partitions. Only loads reaching into the hull of the request's queue spans can
    # overlap them; most (H2D after admission) cannot and are dropped before any sort.
    every = bool(tiles.all())  # then no request's spans need selecting by `tiles`
    q = states.where(states.stage == _QUEUE)
    if not every:
        q = q.where(tiles.take(q.r))
    q_lo = np.full(n, np.iinfo(np.int64).max)
    q_hi = np.full(n, np.iinfo(np.int64).min)
    np.minimum.at(q_lo, q.r, q.start)
    np.maximum.at(q_hi, q.r, q.end)
    cand = loads if every else loads.where(tiles.take(loads.r))
    cand = cand.where((cand.start < q_hi.take(cand.r)) & (cand.end > q_lo.take(cand.r)))
    if len(cand.r):
        ids, compact = compact_ids(cand.r)
        lg = compact.take(cand.r)
        ls, le = clip_to_window(lg, cand.start, cand.end, origin.take(ids), stop.take(ids))
        q = q.where(compact.take(q.r) >= 0)
        qg = compact.take(q.r)
        qs, qe = clip_to_window(qg, q.start, q.end, origin.take(ids), stop.take(ids))
        # L at level 0, Q at level 1: |L| and |L ∪ Q|.
        cat = np.concatenate  # (`np.r_` costs more than the copies at these sizes)
        u = nested_union_lengths(cat((lg, qg)), cat((ls, qs)), cat((le, qe)),
                                 cat((np.zeros(len(lg), np.int64), np.ones(len(qg), np.int64))),
                                 origin[ids], ttft[ids], 2)
        hidden[ids] = stage_ns[ids, _QUEUE] + u[0] - u[1]

    # Derived and repaired partitions: the sweep line's queue time.
    redo = derived | (has_state & ~tiles)
    if not redo.any():
        return hidden
    other = loads.where(redo[loads.r])
    if not len(other.r):
        return hidden
    ids, compact = compact_ids(other.r)
    lg = compact[other.r]
    ls, le = clip_to_window(lg, other.start, other.end, origin[ids], stop[ids])
    # Repaired partitions come from their state spans, derived ones from their activities
    # (`acts` holds only derived requests' spans, `states` none of theirs).
    p = _Sel(*(np.r_[a, b] for a, b in zip(
        (states.r, states.start, states.end, states.stage),
        (acts.r, acts.start, acts.end, acts.stage), strict=True)))
    p = p.where(compact[p.r] >= 0)
    pg = compact[p.r]
    ps, pe = clip_to_window(pg, p.start, p.end, origin[ids], stop[ids])
    q_rank = int(STAGE_RANK[_QUEUE])
    # L at level 0, P at rank + 1: row k + 1 is |L ∪ P<=k|.
    u = nested_union_lengths(np.r_[lg, pg], np.r_[ls, ps], np.r_[le, pe],
                             np.r_[np.zeros(len(lg), np.int64), STAGE_RANK[p.stage] + 1],
                             origin[ids], ttft[ids], q_rank + 2)
    hidden[ids] = stage_ns[ids, _QUEUE] - u[q_rank + 1] + u[q_rank]
    return hidden


def _frame(requests: pd.DataFrame, by_stage: np.ndarray, ttft: np.ndarray, hidden: np.ndarray,
           has_ft: np.ndarray, derived: np.ndarray, violation: np.ndarray | None
           ) -> pd.DataFrame:
    """The partition frame; `by_stage` holds a row per stage (`STAGE_COLUMNS` order)."""
    n = len(requests)
    na = ~has_ft

    def nullable(values: np.ndarray, mask: np.ndarray, fresh: bool = True
                 ) -> pd.arrays.IntegerArray:
        # Each column its own values and mask (`build_frame` copies no extension array): a
        # write into one column of the frame reaches no other column, and not `requests`
        # (whose own buffers `int_column` may hand out: `fresh` False).
        own = fresh and (values.flags.owndata or (values.base is by_stage))
        return pd.arrays.IntegerArray(values.astype(np.int64, copy=not own), mask.copy())

    def opt(col: str) -> Any:
        if col in requests:
            # A copy of the column's array: for Arrow-backed strings, of the array object
            # only (the string data is shared, never rewritten).
            a = column_array(requests, col)
            return requests[col].array.copy() if isinstance(a, np.ndarray) else a.copy()
        return pd.array([None] * n, dtype="str")

    out: dict[str, Any] = {
        "request_id": opt("request_id"),
        "tenant": opt("tenant"),
        "workload_class": opt("workload_class"),
        "hit_class": _hit_class(requests),
        "status": opt("status"),
        "arrival_ns": int_column(requests, "arrival_ns"),  # copied into its block
    }
    first = int_column(requests, "first_token_ns", 0)
    out["first_token_ns"] = nullable(first, na, fresh=False)
    for j, col in enumerate(STAGE_COLUMNS):
        out[col] = nullable(by_stage[j], na)
    out["ttft_ns"] = nullable(ttft, na)
    out["hidden_load_ns"] = nullable(hidden, na)
    if "finish_ns" in requests:
        finish = int_column(requests, "finish_ns", 0)
        has_fin = valid_column(requests, "finish_ns")
    else:
        finish, has_fin = np.zeros(n, np.int64), np.zeros(n, bool)
    arrival = out["arrival_ns"]
    out_tok = (int_column(requests, "output_tokens", 0) if "output_tokens" in requests
               else np.zeros(n, np.int64))
    itl_ok = has_ft & has_fin & (out_tok > 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["itl_ns"] = np.where(itl_ok, (finish - first) / np.maximum(out_tok - 1, 1), np.nan)
    out["e2e_ns"] = nullable(finish - arrival, ~has_fin)
    out["derived"] = derived
    # Through Arrow: the same large_string array `pd.array(violation, dtype="str")` builds,
    # without pandas' per-element inference.
    if violation is None:  # a clean run: a copy of the all-null column (its data shared)
        out["violation"] = _no_violations(n).copy()
    else:
        out["violation"] = pd.array(pa.array(violation, type=pa.large_string(),
                                             from_pandas=True), dtype="str")
    return build_frame(out, n)


@lru_cache(maxsize=4)
def _no_violations(n: int) -> Any:
    """The ``violation`` column of `n` clean requests (all null): made once per length; each
    partition takes a copy (an Arrow-backed array's copy shares the immutable Arrow data, and
    a write into it replaces its own array, never this one's)."""
    return pd.array(pa.nulls(n, pa.large_string()), dtype="str")


def violations(part: pd.DataFrame) -> pd.DataFrame:
    """The rows of a partition whose input broke the partition rules (``violation`` set)."""
    return part.loc[part["violation"].notna(), ["request_id", "violation", "ttft_ns", "derived"]]
