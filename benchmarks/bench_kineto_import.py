"""Kineto import speed: kvscope's importer vs Holistic Trace Analysis' loader, same file, same run.

    .venv/bin/python benchmarks/bench_kineto_import.py [--repeats 15] [--trace PATH]

Runs the two loaders alternately (HTA, kvscope, HTA, kvscope, …) after one warm-up each, so
machine noise hits both alike, and prints the median of each, the ratio of medians, and the
median and spread of the per-pair ratios. Target: kvscope ≥ 3× faster.

HTA (PyPI `HolisticTraceAnalysis`) pulls in Jupyter, so it belongs in a benchmark-only extra;
without it (or without ../shared/data) the benchmark says why and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "data" / "kineto" / "sampled_rank-0.json.gz"


def _hta_loader(trace: Path, workdir: Path) -> Callable[[], object]:
    # HTA reads a directory of per-rank traces; a symlink keeps the bytes identical.
    link = workdir / trace.name
    if not link.exists():
        os.symlink(trace, link)
    from hta.trace_analysis import TraceAnalysis

    def run() -> object:
        return TraceAnalysis(trace_dir=str(workdir))

    return run


def _ours(trace: Path) -> Callable[[], object]:
    from analyzers.importers import load

    def run() -> object:
        return load(trace)

    return run


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15, help="timed pairs (default 15)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Kineto .json(.gz)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not args.trace.exists():
        print(f"skip: trace not found ({args.trace}); ../shared/data is absent")
        return 0
    try:
        import hta  # noqa: F401
    except ImportError:
        print("skip: HolisticTraceAnalysis not installed "
              "(pip install HolisticTraceAnalysis; benchmark-only extra)")
        return 0
    logging.disable(logging.WARNING)  # HTA logs every parse at INFO/WARNING
    return _run(args.trace, args.repeats)


def _run(trace: Path, repeats: int) -> int:
    try:
        import orjson  # noqa: F401

        parser = "orjson"
    except ImportError:
        parser = "json (orjson not installed)"
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-hta-") as d:
        hta_run = _hta_loader(trace, Path(d))
        ours_run = _ours(trace)
        _time(hta_run)  # warm-up: imports, caches
        _time(ours_run)
        hta_s, ours_s = [], []
        for _ in range(repeats):
            hta_s.append(_time(hta_run))
            ours_s.append(_time(ours_run))
    ratios = sorted(h / o for h, o in zip(hta_s, ours_s, strict=True))
    mh, mo = statistics.median(hta_s), statistics.median(ours_s)
    lo, hi = ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]
    print(f"trace: {trace} ({trace.stat().st_size:,} bytes), {repeats} interleaved pairs, "
          f"kvscope parser: {parser}")
    print(f"HTA TraceAnalysis load : median {mh * 1e3:8.1f} ms  (min {min(hta_s) * 1e3:.1f})")
    print(f"kvscope importers.load : median {mo * 1e3:8.1f} ms  (min {min(ours_s) * 1e3:.1f})")
    print(f"speed-up (ratio of medians): {mh / mo:.1f}x; per-pair ratio median "
          f"{statistics.median(ratios):.1f}x, 10-90% range {lo:.1f}x-{hi:.1f}x; target >= 3x")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
