"""Benchmark: the analyzer (TTFT partition + aggregates + token accounting) from Parquet, against
DuckDB computing the same outputs and against a per-request Python loop.

The store: a real run's span mix. ``kvscope run`` (docqa, ``--model tiny``, host + file://
tiers) writes a real run store (or ``--run DIR`` names one); it is tiled ``--copies`` times
(request ids, request numbers, times, step and transfer ids shifted per copy, so that every
copy is a distinct, equally valid stretch of the same run) into a store of ~10 M span rows
(``--copies 450`` of the default 300-request run: 9,994,500 span rows, of which 2.0 M state and
activity rows, the rest steps and ledger rows).

Measures, each printed with its interval and the load average:

1. *analyzer vs DuckDB, whole process*: a fresh process per run. kvscope: ``open_run`` with
   column projection and predicate push-down (`analyzers.ttft.PARTITION_SPAN_COLUMNS`, rows of
   `PARTITION_SPAN_KINDS`), then ``partition`` + ``summarize`` + ``token_accounting``. DuckDB:
   one SQL query over the same Parquet files computing the same outputs (per stage, TTFT and
   hidden load: p50/p90/p99, mean, total; accounting totals), valid for recorded partitions
   that tile TTFT (every request of a kvscope run; checked: the outputs of both are compared
   before any timing, and a difference stops the benchmark). Interleaved pairs (order
   alternating), median per-pair ratio with a distribution-free interval; span rows/s of each.
2. *``kvscope analyze RUN --format json``, whole process*: the full report (partition, cost
   model, consistency check, diagnoses), ``--full-reps`` runs; span rows/s.
3. *vectorised vs a per-request Python loop*: the same analysis on a subsample of the store's
   requests, both given the same frames (measure 1's projected, filtered read; spans matched
   by request_num on both sides): the partition, then everything `summarize` reports for the
   whole run (per stage, TTFT and hidden load: p50/p90/p99, mean, total, mean share and share
   of the total; the slowest requests' mean and share per stage; per window the request count
   and the p50/p90/p99 of TTFT and each stage) and the accounting totals; in process, CPU
   time, interleaved pairs, after checking that both give the same numbers; median per-pair
   ratio with its interval.

Usage::

    .venv/bin/python benchmarks/bench_analyzers.py [--run DIR] [--copies 450] [--pairs 7]
        [--full-reps 1] [--subsample 10000] [--sub-pairs 5] [--store DIR] [--measures 1,2,3]

``--store DIR`` keeps the tiled store in DIR (written there once, ~16 s; a later run given the
same DIR reads it instead of tiling again, whatever ``--run`` and ``--copies`` say);
``--measures`` runs only the measures named (``--measures 3``: the loop comparison alone).

DuckDB (PyPI ``duckdb``) is a benchmark-only dependency (the ``bench`` extra); without it
measure 1 is skipped with a note.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchstats import child_env, load_average, median_interval

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    import pandas as pd

PART_ROWS = 1_000_000
#: `agent.schema.TTFT_STAGES` and `STAGE_PRIORITY`, spelled out so that the DuckDB child
#: process imports nothing of kvscope's (checked against the schema in `main`).
STAGES = ("lookup", "queue", "remote_read", "h2d", "sync", "prefill", "other")
LOADS = ("remote_read", "prefetch", "h2d", "host_read")
QUANTILES = (0.5, 0.9, 0.99)
#: `agent.schema.STAGE_PRIORITY`: the sweep line's order, highest first.
PRIORITY = ("prefill", "sync", "h2d", "queue", "remote_read", "lookup", "other")
_RANK = {s: i for i, s in enumerate(PRIORITY)}
_LOADS = set(LOADS)


# ------------------------------------------------------------------------------------------
# The store: a real run, tiled.
# ------------------------------------------------------------------------------------------


def make_real_run(out: Path, requests: int = 300) -> Path:
    """A real run of our engine with host and file:// tiers (about 90 s on 2 cores)."""
    subprocess.run([sys.executable, "-m", "kvscope.cli", "run", "-n", str(requests),
                    "--model", "tiny", "--num-blocks", "64", "--host-blocks", "256",
                    "--remote", f"file://{out.parent / 'remote-tier'}", "--out", str(out),
                    "-q"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def tile_run(src: Path, dst: Path, copies: int) -> dict[str, int]:
    """Write `copies` shifted copies of run store `src` into a new run store `dst`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from agent.runstore import RunStoreWriter, open_run

    s = open_run(src)
    req, sp, lay = s.tables["requests"], s.tables["spans"], s.tables["layers"]
    t_lo = pc.min(req["arrival_ns"]).as_py()
    t_hi = max(pc.max(sp["end_ns"]).as_py(), pc.max(req["finish_ns"]).as_py() or 0)
    period = t_hi - t_lo + 1_000_000
    n_req = pc.max(req["request_num"]).as_py() + 1
    n_step = (pc.max(sp["step_id"]).as_py() or 0) + 1
    n_tid = (pc.max(sp["transfer_id"]).as_py() or 0) + 1

    def shift(t: pa.Table, col: str, by: int) -> pa.Table:
        return t.set_column(t.column_names.index(col), col,
                            pc.add(t[col], pa.scalar(by, t[col].type)))

    def rename(t: pa.Table, k: int) -> pa.Table:
        i = t.column_names.index("request_id")
        return t.set_column(i, "request_id", pc.binary_join_element_wise(
            pa.scalar(f"t{k}-"), t["request_id"], ""))

    w = RunStoreWriter(dst, config=s.meta.get("config"), run_id=f"tiled-{copies}")
    spans: list[pa.Table] = []
    reqs, lays, pending = [], [], 0
    for k in range(copies):
        r = shift(rename(req, k), "request_num", k * n_req)
        for c in ("arrival_ns", "first_token_ns", "finish_ns"):
            r = shift(r, c, k * period)
        reqs.append(r)
        x = shift(rename(sp, k), "request_num", k * n_req)
        for c in ("start_ns", "end_ns"):
            x = shift(x, c, k * period)
        x = shift(shift(x, "step_id", k * n_step), "transfer_id", k * n_tid)
        wo = x["waits_on"].combine_chunks()
        wo = pa.ListArray.from_arrays(wo.offsets, pc.add(wo.values, pa.scalar(k * n_tid,
                                                                             pa.int64())),
                                      type=wo.type, mask=wo.is_null())
        spans.append(x.set_column(x.column_names.index("waits_on"), "waits_on", wo))
        pending += x.num_rows
        if pending >= PART_ROWS:
            w.write("spans", pa.concat_tables(spans))
            spans, pending = [], 0
        lays.append(rename(lay, k))
    if spans:
        w.write("spans", pa.concat_tables(spans))
    w.write("requests", pa.concat_tables(reqs))
    w.write("layers", pa.concat_tables(lays))
    w.write("samples", s.tables["samples"])
    w.write("events", s.tables["events"])
    w.close()
    meta = json.loads((dst / "run.json").read_text())
    meta.update(start_ns=s.meta.get("start_ns"), status="complete",
                end_ns=(s.meta.get("start_ns") or t_lo) + copies * period)
    (dst / "run.json").write_text(json.dumps(meta))
    return {"requests": req.num_rows * copies, "spans": sp.num_rows * copies}


# ------------------------------------------------------------------------------------------
# Measure 1: the two processes. Each prints the same JSON document.
# ------------------------------------------------------------------------------------------

_OUT_STATS = ("p50", "p90", "p99", "mean", "total")


def kvscope_outputs(run: Path, whole: bool = False) -> dict[str, Any]:
    """kvscope's analyzer from Parquet: the projected, filtered read, then the analysis
    (`whole`: every span column and row read, spans matched by their string request_id, as
    before projection)."""
    from agent.runstore import open_run
    from analyzers.accounting import token_accounting
    from analyzers.ttft import PARTITION_SPAN_COLUMNS, PARTITION_SPAN_KINDS, partition, summarize

    store = open_run(run, tables=("requests", "spans")) if whole else open_run(
        run, tables=("requests", "spans"), columns={"spans": PARTITION_SPAN_COLUMNS},
        filters={"spans": [("kind", "in", list(PARTITION_SPAN_KINDS))]})
    part = partition(store.requests, store.spans)
    st = summarize(part).stages.set_index("stage")
    acct = token_accounting(store.requests)
    out: dict[str, Any] = {"requests": int(part["ttft_ns"].notna().sum()),
                           "violations": int(part["violation"].notna().sum()),
                           "derived": int(part["derived"].sum())}
    for name in (*STAGES, "ttft", "hidden_load"):
        row = st.loc[name]
        out[name] = [float(row["p50_ns"]), float(row["p90_ns"]), float(row["p99_ns"]),
                     float(row["mean_ns"]), int(row["total_ns"])]
    out["totals"] = {k: int(v) for k, v in acct.totals.items()}
    return out


def _duckdb_sql(run: Path, accounting: list[str]) -> str:
    spans = f"read_parquet('{run}/spans/part-*.parquet')"
    requests = f"read_parquet('{run}/requests/part-*.parquet')"
    stage_list = ", ".join(f"'{s}'" for s in STAGES)
    load_list = ", ".join(f"'{s}'" for s in LOADS)
    per_stage = ",\n".join(
        f"coalesce(sum(end_ns - start_ns) FILTER (WHERE name = '{s}'), 0) AS \"{s}\""
        for s in STAGES)
    q = "[" + ", ".join(map(str, QUANTILES)) + "]"
    cols = [*STAGES, "ttft", "hidden_load"]
    aggs = ",\n".join(
        f"quantile_cont(\"{c}\", {q}) AS \"{c}_q\", avg(\"{c}\") AS \"{c}_mean\", "
        f"sum(\"{c}\")::BIGINT AS \"{c}_total\"" for c in cols)
    totals = ", ".join(f"sum({c})::BIGINT AS \"acct_{c}\"" for c in accounting)
    return f"""
    WITH r AS (
        SELECT request_num, arrival_ns AS a, first_token_ns AS f, {', '.join(accounting)}
        FROM {requests} WHERE first_token_ns IS NOT NULL AND first_token_ns >= arrival_ns),
    s AS (
        SELECT sp.request_num, sp.kind, sp.name, sp.start_ns, sp.end_ns, r.a, r.f
        FROM {spans} sp JOIN r USING (request_num)
        WHERE sp.kind IN ('state', 'activity')),
    st AS (SELECT * FROM s WHERE kind = 'state' AND name IN ({stage_list})
                                 AND (start_ns < f OR start_ns = a)),
    per AS (SELECT request_num, {per_stage} FROM st GROUP BY request_num),
    q AS (SELECT request_num, greatest(start_ns, a) AS qs, least(end_ns, f) AS qe
          FROM st WHERE name = 'queue'),
    l AS (SELECT request_num, greatest(start_ns, a) AS ls, least(end_ns, f) AS le
          FROM s WHERE kind = 'activity' AND name IN ({load_list})
                       AND least(end_ns, f) > greatest(start_ns, a)),
    hl AS (SELECT q.request_num,
                  sum(greatest(0, least(qe, le) - greatest(qs, ls))) AS hidden_load
           FROM q JOIN l USING (request_num) GROUP BY q.request_num),
    full_ AS (
        SELECT {', '.join(f'coalesce(per."{s}", 0) AS "{s}"' for s in STAGES)},
               r.f - r.a AS ttft, coalesce(hl.hidden_load, 0) AS hidden_load
        FROM r LEFT JOIN per USING (request_num) LEFT JOIN hl USING (request_num)),
    agg AS (SELECT count(*) AS requests, {aggs} FROM full_),
    tot AS (SELECT {totals} FROM r)
    SELECT * FROM agg, tot
    """


def duckdb_outputs(run: Path, accounting: list[str]) -> dict[str, Any]:
    import duckdb

    con = duckdb.connect()
    cur = con.execute(_duckdb_sql(run, accounting))
    names = [d[0] for d in cur.description]
    row = dict(zip(names, cur.fetchone(), strict=True))
    out: dict[str, Any] = {"requests": int(row["requests"]), "violations": 0, "derived": 0}
    for c in (*STAGES, "ttft", "hidden_load"):
        out[c] = [*(float(x) for x in row[f"{c}_q"]), float(row[f"{c}_mean"]),
                  int(row[f"{c}_total"])]
    out["totals"] = {k[len("acct_"):]: int(v or 0) for k, v in row.items()
                     if k.startswith("acct_")}
    return out


def _child(kind: str, run: Path, accounting: list[str]) -> None:
    out = (duckdb_outputs(run, accounting) if kind == "duckdb"
           else kvscope_outputs(run, whole=kind == "kvscope-whole"))
    sys.stdout.write(json.dumps(out))


def _same_outputs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    bad = []
    for k in a:
        x, y = a[k], b.get(k)
        if isinstance(x, list):
            if not (len(x) == len(y) and x[4] == y[4] and all(
                    math.isclose(p, q, rel_tol=1e-12, abs_tol=1e-3)
                    for p, q in zip(x[:4], y[:4], strict=True))):
                bad.append(f"{k}: kvscope {x} != duckdb {y}")
        elif x != y:
            bad.append(f"{k}: kvscope {x} != duckdb {y}")
    return bad


#: Where the timed children's bytecode cache goes (`main` sets it: its temporary directory,
#: so that a kept ``--store`` gets nothing written beside it).
_PYCACHE: Path | None = None


def _child_env(store: Path) -> dict[str, str]:
    """Every timed child's environment: both sides' modules from one bytecode cache beside the
    store (`benchstats.child_env`), filled by the warm-up runs."""
    return child_env(_PYCACHE if _PYCACHE is not None else store.parent / "pycache")


def _run_child(kind: str, run: Path) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", kind,
                          "--run", str(run)], check=True, capture_output=True, text=True,
                         env=_child_env(run))
    return time.perf_counter() - t0, json.loads(res.stdout)


def _ratio_line(base: list[float], ours: list[float], rows: int) -> None:
    ratios = [o / b for b, o in zip(base, ours, strict=True)]
    lo, hi, cov = median_interval(ratios)
    mb, mo = statistics.median(base), statistics.median(ours)
    print(f"  kvscope median {mo:.2f} s = {rows / mo / 1e6:.2f} M span rows/s; DuckDB median "
          f"{mb:.2f} s = {rows / mb / 1e6:.2f} M span rows/s; kvscope time / DuckDB time "
          f"per-pair median {statistics.median(ratios):.2f}x [{lo:.2f}x, {hi:.2f}x] "
          f"({cov:.0%} interval, {len(ratios)} pairs; goal <= 1.5x)")


# ------------------------------------------------------------------------------------------
# The baseline: what one writes without vectorising — a loop over requests, spans grouped in a
# dict, a sort and a sweep per request, percentiles from sorted lists.
# ------------------------------------------------------------------------------------------


def _union(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        elif e > s:
            out.append((s, e))
    return out


def _length(iv: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in _union(iv))


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    total = 0
    for s1, e1 in _union(a):
        for s2, e2 in _union(b):
            total += max(0, min(e1, e2) - max(s1, s2))
    return total


def _sweep(a: int, f: int, iv: list[tuple[str, int, int]]) -> dict[str, int]:
    """Priority sweep over clipped intervals: the top stage of each elementary segment."""
    cuts = sorted({a, f, *(min(max(s, a), f) for _, s, _ in iv),
                   *(min(max(e, a), f) for _, _, e in iv)})
    out = dict.fromkeys(STAGES, 0)
    for lo, hi in pairwise(cuts):
        top = "other"
        for n, s, e in iv:
            if s <= lo and e >= hi and _RANK[n] < _RANK[top]:
                top = n
        out[top] += hi - lo
    return out


def python_partition(requests: pd.DataFrame, spans: pd.DataFrame) -> list[dict[str, Any]]:
    """Spans matched to requests by the key the vectorised analyzer uses: the int64
    request_num when the spans carry no request_id (the projected read), else the id."""
    key = "request_num" if "request_id" not in spans else "request_id"
    by_req: dict[Any, list[tuple[str, str, int, int]]] = defaultdict(list)
    for k, kind, name, s, e in zip(spans[key].tolist(), spans["kind"].tolist(),
                                   spans["name"].tolist(), spans["start_ns"].tolist(),
                                   spans["end_ns"].tolist(), strict=True):
        if k is not None and k == k:
            by_req[k].append((kind, name, s, e))
    rows = []
    for rid, k, a, f in zip(requests["request_id"].tolist(), requests[key].tolist(),
                            requests["arrival_ns"].tolist(),
                            requests["first_token_ns"].tolist(), strict=True):
        if f is None or f != f:
            continue
        mine = by_req.get(k, [])
        states = [(n, s, e) for k, n, s, e in mine
                  if k == "state" and n in _RANK and (s < f or s == a)]
        chain = sorted((s, e) for _, s, e in states)
        tiles = bool(chain) and chain[0][0] == a and chain[-1][1] == f and all(
            x[1] == y[0] for x, y in pairwise(chain)) and all(
            e >= s for s, e in chain)
        if tiles:
            stage = dict.fromkeys(STAGES, 0)
            for n, s, e in states:
                stage[n] += e - s
        elif states:
            stage = _sweep(a, f, states)
        else:
            stage = _sweep(a, f, [(n, s, e) for k, n, s, e in mine
                                  if k == "activity" and n in _RANK])
        loads = [(max(s, a), min(e, f)) for k, n, s, e in mine
                 if k == "activity" and n in _LOADS and min(e, f) > max(s, a)]
        queue = [(max(s, a), min(e, f)) for n, s, e in states if n == "queue"]
        rows.append({"request_id": rid, "arrival_ns": a,
                     **{f"{k}_ns": v for k, v in stage.items()},
                     "ttft_ns": f - a, "hidden_load_ns": _intersect(queue, loads)})
    return rows


def _pct(sorted_v: list[int], q: float) -> float:
    h = (len(sorted_v) - 1) * q
    j = int(h)
    if j + 1 >= len(sorted_v):
        return float(sorted_v[j])
    return sorted_v[j] + (h - j) * (sorted_v[j + 1] - sorted_v[j])


#: `analyzers.ttft_summary`'s candidate window lengths: 1-2-5 steps from 1 ms to about a day.
_NICE_WINDOWS_NS = tuple(m * 10**e for e in range(6, 14) for m in (1, 2, 5))


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def python_analysis(requests: pd.DataFrame, spans: pd.DataFrame) -> dict[str, Any]:
    """Everything `vectorised` reports, by loops over requests: the partition; per stage,
    TTFT and hidden load the p50/p90/p99, mean, total, mean share of TTFT and share of the
    total; the slowest requests' (at or above the p99 TTFT) mean and share per stage; per
    window of arrivals (the same ~10 round windows) the request count and the p50/p90/p99 of
    TTFT and each stage; the accounting totals."""
    from agent.schema import ACCOUNTING_COLUMNS

    rows = python_partition(requests, spans)
    stages = [f"{s}_ns" for s in STAGES]
    n = len(rows)
    ttft_total = sum(r["ttft_ns"] for r in rows)
    summary = {}
    for col in [*stages, "ttft_ns", "hidden_load_ns"]:
        v = sorted(r[col] for r in rows)
        total = sum(v)
        summary[col] = {
            "q": [_pct(v, q) for q in QUANTILES], "mean": total / n, "total": total,
            "share_mean": _mean([r[col] / r["ttft_ns"] for r in rows if r["ttft_ns"] > 0]),
            "share_of_total": total / ttft_total if ttft_total > 0 else float("nan")}
    threshold = _pct(sorted(r["ttft_ns"] for r in rows), 0.99)
    slow = [r for r in rows if r["ttft_ns"] >= threshold]
    slow_ttft = sum(r["ttft_ns"] for r in slow)
    slowest = {"threshold": threshold, "requests": len(slow),
               **{col: (_mean([r[col] for r in slow]), sum(r[col] for r in slow) / slow_ttft)
                  for col in stages}}
    arrivals = [r["arrival_ns"] for r in rows]
    lo, hi = min(arrivals), max(arrivals)
    width = next((w for w in _NICE_WINDOWS_NS if w * 10 >= hi - lo), _NICE_WINDOWS_NS[-1])
    by_window: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_window[lo + (r["arrival_ns"] - lo) // width * width].append(r)
    windows = {}
    for start in sorted(by_window):
        mine = by_window[start]
        windows[start] = {"requests": len(mine), **{
            col: [_pct(v, q) for q in QUANTILES]
            for col in ("ttft_ns", *stages) for v in [sorted(r[col] for r in mine)]}}
    totals = dict.fromkeys(ACCOUNTING_COLUMNS, 0)
    for rec in requests.to_dict("records"):
        if rec["first_token_ns"] is not None and rec["first_token_ns"] == rec["first_token_ns"]:
            for c in ACCOUNTING_COLUMNS:
                totals[c] += int(rec[c])
    return {"rows": rows, "summary": summary, "slowest": slowest, "windows": windows,
            "totals": totals}


def _close(a: float, b: float) -> bool:
    """Equal to the 1e-3 ns the summaries are rounded to (shares: to 1e-9 relative)."""
    return (a != a and b != b) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-3)


def _same_answers(vec: dict[str, Any], py: dict[str, Any]) -> None:
    part = vec["part"].set_index("request_id")
    for r in py["rows"]:
        got = part.loc[r["request_id"]]
        for k, v in r.items():
            if k != "request_id" and int(got[k]) != v:
                raise AssertionError(f"{r['request_id']} {k}: vectorised {got[k]} != {v}")
    summ = vec["summary"]
    st = summ.stages.set_index("stage")
    for col, want in py["summary"].items():
        name = col[:-3]
        mine = [st.loc[name, c] for c in ("p50_ns", "p90_ns", "p99_ns", "mean_ns", "total_ns",
                                          "share_mean", "share_of_total")]
        theirs = [*want["q"], want["mean"], want["total"], want["share_mean"],
                  want["share_of_total"]]
        if not all(_close(float(x), float(y)) for x, y in zip(mine, theirs, strict=True)):
            raise AssertionError(f"{name}: vectorised {mine} != loop {theirs}")
    slow = summ.slowest.set_index("stage")
    sw = py["slowest"]
    for col in (f"{s}_ns" for s in STAGES):
        got = slow.loc[col[:-3]]
        if not (_close(float(got["threshold_ns"]), sw["threshold"])
                and int(got["requests"]) == sw["requests"]
                and _close(float(got["mean_ns"]), sw[col][0])
                and _close(float(got["share"]), sw[col][1])):
            raise AssertionError(f"slowest {col}: vectorised {got.to_dict()} != loop {sw[col]}")
    win = summ.windows.set_index("window_start_ns")
    if sorted(win.index.tolist()) != list(py["windows"]):
        raise AssertionError("windows differ")
    for start, want in py["windows"].items():
        got = win.loc[start]
        if int(got["requests"]) != want["requests"]:
            raise AssertionError(f"window {start}: request counts differ")
        for col, qs in want.items():
            if col == "requests":
                continue
            mine = [float(got[f"{col[:-3]}_{c}"]) for c in ("p50_ns", "p90_ns", "p99_ns")]
            if not all(_close(x, y) for x, y in zip(mine, qs, strict=True)):
                raise AssertionError(f"window {start} {col}: vectorised {mine} != loop {qs}")
    if vec["acct"].totals != py["totals"]:
        raise AssertionError("accounting totals differ")


def _subsample(requests: pd.DataFrame, spans: pd.DataFrame, n: int
               ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The first `n` requests and their spans (matched by request_num, as read)."""
    sub = requests.iloc[:n].reset_index(drop=True)
    keep = spans["request_num"].isin(sub["request_num"]).fillna(False).to_numpy(dtype=bool)
    return sub, spans.loc[keep].reset_index(drop=True)


def _timed(fn: Any, *args: Any) -> tuple[float, Any, float]:
    """(wall seconds, result, CPU seconds of this process)."""
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out, time.process_time() - c0


def vectorised(requests: pd.DataFrame, spans: pd.DataFrame) -> dict[str, Any]:
    from analyzers.accounting import token_accounting
    from analyzers.ttft import partition, summarize

    part = partition(requests, spans)
    return {"part": part, "summary": summarize(part), "acct": token_accounting(requests)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="a real run store to tile (default: make one)")
    ap.add_argument("--copies", type=int, default=450, help="copies of the run (default 450)")
    ap.add_argument("--pairs", type=int, default=7, help="interleaved whole-process pairs")
    ap.add_argument("--full-reps", type=int, default=1,
                    help="runs of `kvscope analyze --format json` (0: skip)")
    ap.add_argument("--subsample", type=int, default=10_000, help="requests for measure 3")
    ap.add_argument("--sub-pairs", type=int, default=5, help="interleaved pairs, measure 3")
    ap.add_argument("--store", type=Path,
                    help="keep the tiled store here (an existing one is read, not rewritten)")
    ap.add_argument("--measures", default="1,2,3",
                    help="comma-separated measures to run (default 1,2,3)")
    ap.add_argument("--child", choices=("kvscope", "kvscope-whole", "duckdb"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--accounting", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.run, [c for c in args.accounting.split(",") if c])
        return 0

    from agent.schema import ACCOUNTING_COLUMNS, STAGE_PRIORITY, TTFT_STAGES
    from analyzers.ttft import LOAD_ACTIVITIES

    assert (tuple(TTFT_STAGES), tuple(LOAD_ACTIVITIES), tuple(STAGE_PRIORITY)) == (
        STAGES, LOADS, PRIORITY), "update STAGES, LOADS, PRIORITY"
    measures = {m.strip() for m in args.measures.split(",") if m.strip()}
    if not measures <= {"1", "2", "3"}:
        ap.error(f"--measures: expected 1, 2 or 3, got {args.measures}")
    print(f"load average at start: {load_average()}")
    global _PYCACHE
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-analyzers-") as tmp:
        _PYCACHE = Path(tmp) / "pycache"
        store = args.store if args.store is not None else Path(tmp) / "tiled"
        if (store / "run.json").exists():
            rows = _store_rows(store)
            print(f"store: {store} (kept from an earlier run): {rows['requests']:,} requests, "
                  f"{rows['spans']:,} span rows")
        else:
            src = args.run
            if src is None:
                t0 = time.perf_counter()
                src = make_real_run(Path(tmp) / "real")
                print(f"real run: kvscope run -n 300 --model tiny, host + file:// tiers "
                      f"({time.perf_counter() - t0:.0f} s)")
            t0 = time.perf_counter()
            rows = tile_run(src, store, args.copies)
            print(f"store: {args.copies} copies of {src}: {rows['requests']:,} requests, "
                  f"{rows['spans']:,} span rows ({time.perf_counter() - t0:.0f} s to write)")
        n_spans = rows["spans"]
        if "1" in measures:
            _measure_duckdb(store, n_spans, args.pairs, list(ACCOUNTING_COLUMNS))
        if "2" in measures:
            _measure_full(store, n_spans, args.full_reps)
        if "3" in measures:
            _measure_loop(store, args.subsample, args.sub_pairs)
    print(f"load average at end: {load_average()}")
    return 0


def _store_rows(store: Path) -> dict[str, int]:
    """Row counts of a kept store's requests and spans (from the Parquet footers)."""
    import pyarrow.parquet as pq

    def rows(table: str) -> int:
        return sum(pq.ParquetFile(f).metadata.num_rows
                   for f in sorted((store / table).glob("part-*.parquet")))

    return {"requests": rows("requests"), "spans": rows("spans")}


def _measure_duckdb(store: Path, n_spans: int, pairs: int, accounting: list[str]) -> None:
    try:
        import duckdb  # noqa: F401
    except ImportError:
        print("1. skipped: duckdb not installed (pip install -e '.[bench]')")
        return

    def duck() -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                              "duckdb", "--run", str(store), "--accounting",
                              ",".join(accounting)], check=True, capture_output=True, text=True,
                             env=_child_env(store))
        return time.perf_counter() - t0, json.loads(res.stdout)

    _, ours = _run_child("kvscope", store)  # warm-up, and the answers compared
    _, theirs = duck()
    bad = _same_outputs(ours, theirs)
    if bad:
        raise SystemExit("kvscope and DuckDB differ:\n  " + "\n  ".join(bad))
    print(f"1. analyzer vs DuckDB from Parquet, whole process: same outputs checked "
          f"({ours['requests']:,} requests, {ours['violations']} violations, "
          f"{ours['derived']} derived; load average {load_average()})")
    k_s, d_s, w_s = [], [], []
    for i in range(pairs):
        order = (("k", "d", "w") if i % 2 == 0 else ("w", "d", "k"))
        for who in order:
            if who == "k":
                k_s.append(_run_child("kvscope", store)[0])
            elif who == "w":
                secs, whole = _run_child("kvscope-whole", store)
                if whole != ours:
                    raise SystemExit("kvscope's whole read and projected read differ")
                w_s.append(secs)
            else:
                d_s.append(duck()[0])
    _ratio_line(d_s, k_s, n_spans)
    print("  the same analysis reading every span column and row (as before projection): "
          f"median {statistics.median(w_s):.2f} s = "
          f"{n_spans / statistics.median(w_s) / 1e6:.2f} M span rows/s; projected/whole "
          f"per-run median {statistics.median(k_s) / statistics.median(w_s):.2f}x")
    print(f"  load average after: {load_average()}")


def _measure_full(store: Path, n_spans: int, reps: int) -> None:
    if reps < 1:
        return
    secs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kvscope.cli", "analyze", str(store), "--format",
                        "json", "-o", os.devnull], check=True, cwd=ROOT,
                       stderr=subprocess.DEVNULL, env=_child_env(store))
        secs.append(time.perf_counter() - t0)
    med = statistics.median(secs)
    print(f"2. kvscope analyze RUN --format json, whole process (the full report): "
          f"{', '.join(f'{s:.1f}' for s in secs)} s, median {med:.1f} s = "
          f"{n_spans / med / 1e6:.2f} M span rows/s (load average {load_average()})")


def _measure_loop(store: Path, n: int, pairs: int) -> None:
    from agent.runstore import open_run
    from analyzers.ttft import PARTITION_SPAN_COLUMNS, PARTITION_SPAN_KINDS

    # Both sides get the same frames: the projected, filtered read of measure 1.
    s = open_run(store, tables=("requests", "spans"),
                 columns={"spans": PARTITION_SPAN_COLUMNS},
                 filters={"spans": [("kind", "in", list(PARTITION_SPAN_KINDS))]})
    requests, spans = s.requests, s.spans
    sub_req, sub_spans = _subsample(requests, spans, n)
    del s, requests, spans
    _same_answers(vectorised(sub_req, sub_spans), python_analysis(sub_req, sub_spans))
    vec_t, py_t = [], []
    for i in range(pairs):
        if i % 2 == 0:
            vec_t.append(_timed(vectorised, sub_req, sub_spans)[2])
            py_t.append(_timed(python_analysis, sub_req, sub_spans)[2])
        else:
            py_t.append(_timed(python_analysis, sub_req, sub_spans)[2])
            vec_t.append(_timed(vectorised, sub_req, sub_spans)[2])
    ratios = [p / v for p, v in zip(py_t, vec_t, strict=True)]
    lo, hi, cov = median_interval(ratios)
    print(f"3. vectorised vs per-request Python loop, {len(sub_req):,} requests "
          f"({len(sub_spans):,} span rows), same answers checked, CPU time: loop median "
          f"{statistics.median(py_t):.3f} s, vectorised median {statistics.median(vec_t):.4f} s;"
          f" loop/vectorised per-pair median {statistics.median(ratios):.1f}x "
          f"[{lo:.1f}x, {hi:.1f}x] ({cov:.0%} interval, {pairs} pairs; load average "
          f"{load_average()})")


if __name__ == "__main__":
    sys.exit(main())
