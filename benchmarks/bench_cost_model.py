"""The step cost model on a cold and a warm run of one model and workload, against the old
"recomputed tokens / prefill seconds" rate.

    .venv/bin/python benchmarks/bench_cost_model.py [--model small] [--requests 200]
        [--workload docqa] [--rate 8]

Two `kvscope run`s share a file:// remote tier: the first (cold) fills it, the second (warm)
reuses it. For each the script prints the fitted cost (fixed ms per step, us per scheduled
token, both with their bootstrap 95 % interval, the steps behind them and the per-token
half-width over the estimate), whether the two per-token intervals overlap, and the old rate
computed the old way (recomputed tokens of requests without preemption / their summed
`prefill` stage time), whose cold/warm ratio is what the fitted model replaces.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a source checkout without installing
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from agent.runstore import open_run  # noqa: E402
from analyzers import frames as F  # noqa: E402
from analyzers.costmodel import fit_step_cost  # noqa: E402
from analyzers.ttft import partition  # noqa: E402
from kvscope.session import RunOptions, run_session  # noqa: E402


def old_rate(path: Path) -> tuple[float, int, float]:
    """Wave 1's measured prefill rate: recomputed tokens / prefill seconds over the requests
    with a first token, no preemption and some prefill time (kept here only to compare)."""
    run = open_run(path)
    part = partition(run.requests, run.spans)
    prefill = F.ints(part["prefill_ns"], 0)
    rec = F.ints(run.requests["recomputed_tokens"], 0)
    pre = F.ints(run.requests["num_preemptions"], 0)
    use = F.valid(part["ttft_ns"]) & (pre == 0) & (prefill > 0)
    tokens, seconds = int(rec[use].sum()), int(prefill[use].sum()) / 1e9
    return (tokens / seconds if seconds else float("nan")), tokens, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--workload", default="docqa")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-cost-"))
    try:
        remote = f"file://{tmp / 'remote'}"
        fits = {}
        for name in ("cold", "warm"):
            out = tmp / name
            run_session(RunOptions(out=out, model=args.model, workload=args.workload,
                                   num_requests=args.requests, rate=args.rate, seed=args.seed,
                                   host_blocks=256, remote=remote, metrics_port=0,
                                   collectors=False))
            cost = fit_step_cost(open_run(out).spans)
            rate, tokens, seconds = old_rate(out)
            fits[name] = cost
            print(f"{name:5}  {cost.describe()}")
            print(f"       per-token half-width {100 * cost.per_token_half_width:.1f} % of the "
                  f"estimate; old rate {rate:,.0f} tokens/s ({tokens:,} recomputed tokens / "
                  f"{seconds:,.3f} s of prefill)")
            fits[name + "_old"] = rate
        c, w = fits["cold"], fits["warm"]
        (clo, chi), (wlo, whi) = c.per_token_ci_ns, w.per_token_ci_ns
        overlap = max(clo, wlo) <= min(chi, whi)
        print(f"per-token cost warm / cold: {w.per_token_ns / c.per_token_ns:.2f}x; intervals "
              f"{'overlap' if overlap else 'do not overlap'}; each estimate inside the other's "
              f"interval: {clo <= w.per_token_ns <= chi and wlo <= c.per_token_ns <= whi}")
        print(f"old rate warm / cold: {fits['warm_old'] / fits['cold_old']:.2f}x")
        if not np.isfinite(c.per_token_ns) or not np.isfinite(w.per_token_ns):
            sys.exit(1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
