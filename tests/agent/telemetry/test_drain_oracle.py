"""The drain's tables against the builders they replaced (kept here as the oracle): the same
recorder calls, drained at the same points, give equal tables (values, nulls, types and
schema), whatever the segment sizes, drops, foreign-thread rows and late ids."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from agent.clock import ClockAnchor
from agent.schema import (
    BLOCK_STATES,
    CLOCKS,
    LAYERS_SCHEMA,
    REQUESTS_SCHEMA,
    SAMPLES_SCHEMA,
    SPANS_SCHEMA,
    STATES,
    TIERS,
)
from agent.telemetry import CLOCK_CPU, CLOCK_CUDA, Recorder, RequestAccounting, tables
from agent.telemetry.buffers import Chunk, chunk_waits
from agent.telemetry.states import output_digest
from agent.telemetry.tables import LAYER_COLS, IdLookup, samples_table

# ---------------------------------------------------------------- the replaced builders
_ACTIVITY_KINDS = ("activity", "ledger")
_STEP_ORDER = ("schedule", "prepare", "sample", "forward")


def concat_column(chunks: list[Chunk], i: int) -> np.ndarray:
    """One column across chunks (zero-copy when there is exactly one chunk)."""
    if len(chunks) == 1:
        seg, lo, hi = chunks[0]
        return seg.view(i, lo, hi)
    return np.concatenate([seg.view(i, lo, hi) for seg, lo, hi in chunks])


def int_array(values: np.ndarray, null_below: int | None = None, type_: pa.DataType = pa.int64()
              ) -> pa.Array:
    """An Arrow integer array over `values`; entries < `null_below` become null."""
    if null_below is None:
        return pa.array(values, type=type_)
    mask = values < null_below
    if not mask.any():
        return pa.array(values, type=type_)
    return pa.array(values, type=type_, mask=mask)


def coded_strings(codes: np.ndarray, vocabulary: list[str], null_code: int | None = -1
                  ) -> pa.Array:
    """Decode small integer codes through a vocabulary into a plain Arrow string array."""
    idx = codes.astype(np.int32, copy=False)
    mask = idx == null_code if null_code is not None else None
    has_nulls = mask is not None and bool(mask.any())
    indices = pa.array(idx, mask=mask) if has_nulls else pa.array(idx)
    dictionary = pa.array(vocabulary, type=pa.string())
    return pa.DictionaryArray.from_arrays(indices, dictionary).cast(pa.string())


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




def oracle_spans(state: list[Chunk], act: list[Chunk], step: list[Chunk], steps: list[Chunk],
                 ids: IdLookup, names: list[str], off: int) -> pa.Table:
    parts = []
    if state:
        parts.append(state_table(state, ids, off))
    if act:
        parts.append(activity_table(act, ids, names, off))
    if step or steps:
        parts.append(step_table(step, names, off, steps))
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


ORACLE = {"spans_table": oracle_spans, "layers_table": layers_table,
          "requests_table": requests_table, "engine_samples_table": engine_samples_table}


# ---------------------------------------------------------------- a recorder's life
def drive(seed: int, segment_rows: int, max_segments: int) -> tuple[list[dict[str, pa.Table]],
                                                                      Any]:
    """Random recorder calls (every kind, every thread path) with drains between them."""
    rng = random.Random(seed)
    clk = [1000]

    def clock() -> int:
        clk[0] += rng.randrange(0, 50)
        return clk[0]

    rec = Recorder(segment_rows=segment_rows, max_segments=max_segments, nvtx=False,
                   clock=clock, retain_ids=5, anchor=ClockAnchor(wall_ns=10**18, mono_ns=0))
    open_: list[int] = []
    tids: list[int] = []
    drains = []
    names = ["store", "load", "lookup", "write", "fetch", "computed"]
    for it in range(400):
        r = rng.random()
        if r < 0.08 or not open_:
            rid = f"r{it}" if rng.random() < 0.9 else f"rq-\u00fc-{it}"
            open_.append(rec.request_begin(
                rid, None if rng.random() < 0.5 else clk[0],
                tenant=rng.choice([None, "a", "b"]),
                workload_class=rng.choice([None, "docqa", "chat"]),
                state=rng.choice(["lookup", "queue"])))
        elif r < 0.30:
            rec.stage(rng.choice(open_), rng.randrange(1, 6),
                      None if rng.random() < 0.5 else clk[0] + rng.randrange(-20, 20))
        elif r < 0.34:
            rn = rng.choice(open_)
            tids.append(rec.new_transfer_id())
            rec.wait_for(rn, tids[-1])
            if rng.random() < 0.3:
                rec.wait_for(rn, rng.choice(tids))
        elif r < 0.42:
            rec.activity(rng.choice(names), clk[0], clk[0] + rng.randrange(100),
                         request_num=rng.choice([*open_, -1, 99999]),
                         tier=rng.choice([None, *TIERS]), layer=rng.choice([-1, 0, 3]),
                         tokens=rng.choice([-1, 16]), nbytes=rng.choice([-1, 4096]),
                         transfer_id=rng.choice([-1, *tids[-3:]]),
                         clock=rng.choice([CLOCK_CPU, CLOCK_CUDA]))
        elif r < 0.48:
            rec.ledger(rng.choice(names), rng.choice(open_),
                       t=None if rng.random() < 0.5 else clk[0],
                       tier=rng.choice([None, "host", "remote"]), tokens=rng.choice([-1, 16]),
                       nbytes=rng.choice([-1, 100]), block=rng.choice([-1, 0, 5]),
                       transfer_id=rng.choice([-1, 3]), layer=rng.choice([-1, 2]))
        elif r < 0.52:
            rec.lookups(rng.choice(open_), [
                (t, clk[0], clk[0] + 5, rng.randrange(3), rng.randrange(4))
                for t in rng.sample(TIERS, rng.randrange(1, 4))], 16)
        elif r < 0.62:
            t0 = clk[0]
            rec.engine_step(
                it, t0, t0 + 1, t0 + 2, t0 + 10, t0 + 11,
                None if rng.random() < 0.3 else (t0 + 3, t0 + 9), rng.randrange(1, 9),
                rng.randrange(1, 500), (rng.randrange(9), rng.randrange(9), rng.randrange(9)),
                None if rng.random() < 0.3 else (rng.randrange(9), rng.randrange(9), 1),
                [] if rng.random() < 0.7 else [("remote_get_ok", 3.0, "remote", "operations")])
            clk[0] += 12
        elif r < 0.65:
            rec.step_span(it, rng.choice(["forward", "schedule", "custom"]), clk[0], clk[0] + 4,
                          batch_requests=rng.choice([-1, 2]), tokens=rng.choice([-1, 7]),
                          clock=rng.choice([CLOCK_CPU, CLOCK_CUDA]))
        elif r < 0.67:
            rec.step_spans(it, [("schedule", clk[0], clk[0] + 1, CLOCK_CPU),
                                ("forward", clk[0] + 1, clk[0] + 3, CLOCK_CUDA)],
                           batch_requests=3, tokens=rng.choice([-1, 9]))
        elif r < 0.71:
            rn = rng.choice([*open_, 12345])
            if rng.random() < 0.5:
                rec.layers(rn, [tuple(rng.randrange(100) for _ in range(7))
                                for _ in range(rng.randrange(1, 5))])
            else:
                rec.layer(rn, rng.randrange(4), *(rng.randrange(100) for _ in range(6)))
        elif r < 0.74:
            rec.event(rng.choice(["eviction", "fault"]), t=None if rng.random() < 0.5 else clk[0],
                      request_num=rng.choice([*open_, -1]), detail={"b": it})
        elif r < 0.78:
            t = None if rng.random() < 0.3 else clk[0] - rng.randrange(0, 200)
            if rng.random() < 0.5:
                rec.sample(rng.choice(["pool", "nic"]), rng.choice(["in_use", "rx"]),
                           rng.random(), entity=rng.choice([None, "device", "eth0"]),
                           unit=rng.choice([None, "blocks"]), t=t)
            else:
                rec.samples("pool", [(m, rng.randrange(9), rng.choice([None, "host"]),
                                      rng.choice([None, "blocks"])) for m in ("a", "b")], t=t)
        elif r < 0.81:
            rn = rng.choice(open_)
            v = iter([rng.randrange(100) for _ in range(20)])

            def foreign(rn: int, v: Iterator[int]) -> None:
                rec.activity("fetch", clk[0], clk[0] + next(v), request_num=rn, tier="remote")
                rec.ledger("load", rn, t=clk[0], tier="remote", tokens=16, block=next(v) % 4)
                rec.step_span(9999, "forward", clk[0], clk[0] + 3, tokens=next(v))
                rec.engine_step(10000 + next(v), clk[0], clk[0] + 1, clk[0] + 2, clk[0] + 3,
                                clk[0] + 4, None, 1, 5, (1, 2, 3), None)
                rec.layers(rn, [tuple(next(v) for _ in range(7))])
                rec.sample("pool", "x", 1.5, t=clk[0])

            th = threading.Thread(target=foreign, args=(rn, v))
            th.start()
            th.join()
        elif r < 0.86:
            rn = rng.choice(open_)
            if rng.random() < 0.5:
                rec.first_token(rn, None if rng.random() < 0.5 else clk[0])
            else:
                ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 5))]
                rec.request_end(rn, RequestAccounting(prompt_tokens=32, recomputed_tokens=32),
                                status=rng.choice(["ok", "error"]),
                                t=None if rng.random() < 0.5 else clk[0],
                                output_digest=rng.choice([None, output_digest(ids)]),
                                output_token_ids=rng.choice([None, ids]))
                open_.remove(rn)
        if rng.random() < 0.04:
            drains.append(rec.drain())
    drains.append(rec.drain())
    st = rec.stats
    return drains, (st.dropped, st.recording_errors, st.unknown_requests, st.rows)


@pytest.mark.parametrize("segment_rows,max_segments", [(16384, 64), (7, 3), (3, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_drained_tables_equal_the_replaced_builders(monkeypatch: pytest.MonkeyPatch, seed: int,
                                                    segment_rows: int,
                                                    max_segments: int) -> None:
    new, new_stats = drive(seed, segment_rows, max_segments)
    with monkeypatch.context() as m:
        for name, fn in ORACLE.items():
            m.setattr(tables, name, fn)
        old, old_stats = drive(seed, segment_rows, max_segments)
    assert new_stats == old_stats
    assert len(new) == len(old)
    schemas = {"spans": SPANS_SCHEMA, "layers": LAYERS_SCHEMA, "requests": REQUESTS_SCHEMA,
               "samples": SAMPLES_SCHEMA}
    for got, want in zip(new, old, strict=True):
        assert got.keys() == want.keys()
        for name, table in got.items():
            table.validate(full=True)
            assert table.schema.equals(want[name].schema, check_metadata=True)
            assert table.equals(want[name]), name
            if name in schemas:
                assert table.schema.equals(schemas[name])


def test_samples_without_steps_use_the_shared_builder() -> None:
    rows = [(5, "host", None, "m", 1.5, None)]
    assert tables.engine_samples_table([], rows, 10).equals(samples_table(rows, 10))
