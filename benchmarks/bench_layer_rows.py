"""Per-layer rows: one `Recorder.layers` call per request against one `Recorder.layer` call per
layer, recording the same rows (checked equal) — what the engine does at each first token.

    .venv/bin/python benchmarks/bench_layer_rows.py [--reps 21] [--layers 32] [--requests 2000]

Each repetition times both ways over the same requests in alternating order, on fresh
recorders, in process CPU time; the ratio (per-layer calls / one call) is paired within a
repetition and printed as a median with a distribution-free 95 % interval, with the load
average (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchstats import median_ci  # noqa: E402

from agent.telemetry import Recorder, RequestAccounting  # noqa: E402


def run(batched: bool, layers: int, requests: int) -> tuple[float, list[dict]]:
    rec = Recorder(nvtx=False)
    rns = [rec.request_begin(f"r{i}", i) for i in range(requests)]
    rows = [(16 * i, 16, 32, 48 + 16 * i, 90 * i, 10, 0) for i in range(layers)]
    t0 = time.process_time()
    if batched:
        for rn in rns:
            rec.layers(rn, rows)
    else:
        for rn in rns:
            for layer, r in enumerate(rows):
                rec.layer(rn, layer, r[0], r[1], r[2], r[3], r[4], r[5], r[6])
    dt = time.process_time() - t0
    for rn in rns:
        rec.request_end(rn, RequestAccounting(), t=1)
    return dt, rec.drain()["layers"].slice(0, layers).to_pylist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2000)
    a = ap.parse_args()
    ratios, per_call, one_call = [], [], []
    for rep in range(a.reps):
        order = (True, False) if rep % 2 else (False, True)
        got = {}
        for batched in order:
            got[batched] = run(batched, a.layers, a.requests)
        assert got[True][1] == got[False][1], "the two ways recorded different rows"
        per_call.append(got[False][0])
        one_call.append(got[True][0])
        ratios.append(got[False][0] / got[True][0])
    n = a.requests * a.layers
    m, lo, hi = median_ci(ratios)
    print(f"{a.layers} layers x {a.requests:,} requests, {a.reps} reps, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"  one layer() call per layer : {statistics.median(per_call) / n * 1e9:7.1f} ns "
          "per row (CPU)")
    print(f"  one layers() call / request: {statistics.median(one_call) / n * 1e9:7.1f} ns "
          "per row (CPU)")
    print(f"  ratio (per-layer / batched): {m:.2f}x  (95 % CI {lo:.2f}..{hi:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
