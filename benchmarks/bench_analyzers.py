"""Benchmark: TTFT partition + aggregates over a synthetic run store of 1,000,000 requests.

One run prints:
  1. the synthetic store (requests, span rows), written as Parquet parts and read back with
     `agent.runstore.open_run` (read time reported apart from the analysis);
  2. analysis time over the whole store — `partition` + `summarize` + `token_accounting` —
     as span rows per second (target >= 1 M rows/s), median of the repetitions;
  3. the speedup over a straightforward per-request Python implementation of the same
     analysis, measured on a subsample of the requests in this same run (both implementations
     on the same subsample, interleaved, medians of CPU time), after checking that both give
     the same numbers on it.

Wall time and this process's CPU time are both printed: the machine is shared, and CPU time is
what the analysis itself costs when other processes compete for the cores.

Usage: ``python benchmarks/bench_analyzers.py [--requests 1000000] [--subsample 20000]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the synthetic generator lives with the tests
    sys.path.insert(0, str(ROOT))

from agent.runstore import RunStoreWriter, open_run  # noqa: E402
from agent.schema import ACCOUNTING_COLUMNS, STAGE_PRIORITY, TTFT_STAGES  # noqa: E402
from analyzers.accounting import token_accounting  # noqa: E402
from analyzers.ttft import partition, summarize  # noqa: E402
from tests.synthetic_run import SyntheticConfig, generate  # noqa: E402

PART_ROWS = 1_000_000
_RANK = {s: i for i, s in enumerate(STAGE_PRIORITY)}
_LOADS = {"remote_read", "prefetch", "h2d", "host_read"}


def vectorised(requests: pd.DataFrame, spans: pd.DataFrame) -> dict[str, Any]:
    part = partition(requests, spans)
    summary = summarize(part)
    acct = token_accounting(requests)
    return {"part": part, "summary": summary, "acct": acct}


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
    out = dict.fromkeys(TTFT_STAGES, 0)
    for lo, hi in pairwise(cuts):
        top = "other"
        for n, s, e in iv:
            if s <= lo and e >= hi and _RANK[n] < _RANK[top]:
                top = n
        out[top] += hi - lo
    return out


def python_partition(requests: pd.DataFrame, spans: pd.DataFrame) -> list[dict[str, Any]]:
    by_req: dict[str, list[tuple[str, str, int, int]]] = defaultdict(list)
    for rid, kind, name, s, e in zip(spans["request_id"].tolist(), spans["kind"].tolist(),
                                     spans["name"].tolist(), spans["start_ns"].tolist(),
                                     spans["end_ns"].tolist(), strict=True):
        if rid is not None and rid == rid:
            by_req[rid].append((kind, name, s, e))
    rows = []
    for rid, a, f in zip(requests["request_id"].tolist(), requests["arrival_ns"].tolist(),
                         requests["first_token_ns"].tolist(), strict=True):
        if f is None or f != f:
            continue
        mine = by_req.get(rid, [])
        states = [(n, s, e) for k, n, s, e in mine
                  if k == "state" and n in _RANK and (s < f or s == a)]
        chain = sorted((s, e) for _, s, e in states)
        tiles = bool(chain) and chain[0][0] == a and chain[-1][1] == f and all(
            x[1] == y[0] for x, y in pairwise(chain)) and all(
            e >= s for s, e in chain)
        if tiles:
            stage = dict.fromkeys(TTFT_STAGES, 0)
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
        rows.append({"request_id": rid, **{f"{k}_ns": v for k, v in stage.items()},
                     "ttft_ns": f - a, "hidden_load_ns": _intersect(queue, loads)})
    return rows


def _pct(sorted_v: list[int], q: float) -> float:
    h = (len(sorted_v) - 1) * q
    j = int(h)
    if j + 1 >= len(sorted_v):
        return float(sorted_v[j])
    return sorted_v[j] + (h - j) * (sorted_v[j + 1] - sorted_v[j])


def python_analysis(requests: pd.DataFrame, spans: pd.DataFrame) -> dict[str, Any]:
    rows = python_partition(requests, spans)
    summary = {}
    for col in [*(f"{s}_ns" for s in TTFT_STAGES), "ttft_ns", "hidden_load_ns"]:
        v = sorted(r[col] for r in rows)
        summary[col] = [_pct(v, q) for q in (0.5, 0.9, 0.99)]
    totals = dict.fromkeys(ACCOUNTING_COLUMNS, 0)
    for rec in requests.to_dict("records"):
        if rec["first_token_ns"] is not None and rec["first_token_ns"] == rec["first_token_ns"]:
            for c in ACCOUNTING_COLUMNS:
                totals[c] += int(rec[c])
    return {"rows": rows, "summary": summary, "totals": totals}


def _same_answers(vec: dict[str, Any], py: dict[str, Any]) -> None:
    part = vec["part"].set_index("request_id")
    for r in py["rows"]:
        got = part.loc[r["request_id"]]
        for k, v in r.items():
            if k != "request_id" and int(got[k]) != v:
                raise AssertionError(f"{r['request_id']} {k}: vectorised {got[k]} != {v}")
    st = vec["summary"].stages.set_index("stage")
    for col, qs in py["summary"].items():
        name = col[:-3]
        mine = [st.loc[name, c] for c in ("p50_ns", "p90_ns", "p99_ns")]
        if not np.allclose(mine, qs, rtol=0, atol=1e-3):
            raise AssertionError(f"{name} percentiles {mine} != {qs}")
    if vec["acct"].totals != py["totals"]:
        raise AssertionError("accounting totals differ")


def _subsample(requests: pd.DataFrame, spans: pd.DataFrame, n: int
               ) -> tuple[pd.DataFrame, pd.DataFrame]:
    sub = requests.iloc[:n].reset_index(drop=True)
    keep = spans["request_id"].isin(sub["request_id"]).fillna(False).to_numpy(dtype=bool)
    return sub, spans.loc[keep].reset_index(drop=True)


def _timed(fn: Any, *args: Any) -> tuple[float, Any, float]:
    """(wall seconds, result, CPU seconds of this process)."""
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3, help="full-store repetitions")
    ap.add_argument("--subsample", type=int, default=20_000)
    ap.add_argument("--pairs", type=int, default=5, help="interleaved subsample pairs")
    args = ap.parse_args()

    t0 = time.perf_counter()
    tables = generate(SyntheticConfig(requests=args.requests, seed=0))
    gen_s = time.perf_counter() - t0
    n_spans = tables["spans"].num_rows
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp:
        w = RunStoreWriter(Path(tmp) / "run", run_id="bench")
        t0 = time.perf_counter()
        w.write("requests", tables["requests"])
        for off in range(0, n_spans, PART_ROWS):
            w.write("spans", tables["spans"].slice(off, PART_ROWS))
        w.close()
        write_s = time.perf_counter() - t0
        del tables
        t0 = time.perf_counter()
        store = open_run(Path(tmp) / "run", tables=("requests", "spans"))
        requests, spans = store.requests, store.spans
        read_s = time.perf_counter() - t0
    print(f"synthetic run store: {len(requests):,} requests, {n_spans:,} span rows "
          f"(generated in {gen_s:.1f} s, written as {-(-n_spans // PART_ROWS)} span parts in "
          f"{write_s:.1f} s, read back with open_run in {read_s:.1f} s; reading is not "
          "counted below)")

    full, cpu = [], []
    for _ in range(args.repeat):
        secs, _out, csecs = _timed(vectorised, requests, spans)
        full.append(secs)
        cpu.append(csecs)
        del _out
    med, med_cpu = statistics.median(full), statistics.median(cpu)
    print(f"partition + summarize + token_accounting over the whole store: median {med:.2f} s "
          f"wall of {args.repeat} ({', '.join(f'{s:.2f}' for s in full)} s) = "
          f"{n_spans / med / 1e6:.2f} M span rows/s (target >= 1 M rows/s); CPU time "
          f"{med_cpu:.2f} s = {n_spans / med_cpu / 1e6:.2f} M span rows per CPU-second "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: other processes "
          "share the machine)")

    sub_req, sub_spans = _subsample(requests, spans, args.subsample)
    _same_answers(vectorised(sub_req, sub_spans), python_analysis(sub_req, sub_spans))
    vec_t, py_t = [], []
    for _ in range(args.pairs):
        vec_t.append(_timed(vectorised, sub_req, sub_spans)[2])
        py_t.append(_timed(python_analysis, sub_req, sub_spans)[2])
    ratios = sorted(p / v for p, v in zip(py_t, vec_t, strict=True))
    print(f"subsample of {len(sub_req):,} requests ({len(sub_spans):,} span rows), same answers "
          f"checked: per-request Python median {statistics.median(py_t):.2f} CPU-s vs "
          f"vectorised {statistics.median(vec_t):.3f} CPU-s over {args.pairs} interleaved pairs "
          "-> speedup "
          f"{statistics.median(ratios):.1f}x (range {ratios[0]:.1f}x-{ratios[-1]:.1f}x), "
          "measured on this subsample")
    print(f"per-request Python extrapolated linearly to the whole store: about "
          f"{statistics.median(py_t) * len(requests) / len(sub_req):.0f} CPU-s "
          f"(vs {med_cpu:.1f} CPU-s measured for the vectorised analysis)")


if __name__ == "__main__":
    main()
