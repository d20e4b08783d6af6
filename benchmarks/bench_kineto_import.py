"""Kineto import speed: kvscope's importer vs Holistic Trace Analysis' loader, same file, same run.

    .venv/bin/python benchmarks/bench_kineto_import.py [--repeats 7] [--trace PATH ...]
        [--make-trace N] [--mode both|process|inproc] [--no-shared] [--phases]

Baseline: HTA's ``TraceAnalysis(trace_dir=...)`` (it parses the trace into its per-rank
DataFrames) against kvscope's ``analyzers.importers.load`` (it parses the trace into its spans,
requests and summary: the spans and requests as Arrow tables, the run store's format, which
`ImportedRun` turns into DataFrames when a caller first reads them). Measures per trace:

- *whole process*: a fresh ``python -c`` per load (interpreter start, imports, parse, tables),
  the figure issue 23 asks for; both sides' modules from bytecode caches (`_child_env`);
- *whole process, DataFrames* (kvscope only reads ``.requests`` and ``.spans`` after the load):
  what a caller that wants pandas frames, as HTA hands them, pays (pandas' import, mostly);
- *in process*: the load alone (kvscope's with its DataFrames read), in this process, after
  one warm-up of each.

The loaders run in rounds, each in the reverse order of the one before (HTA, kvscope, kvscope,
HTA, …), so that machine noise and what one run leaves in the caches hit both alike. Printed
per trace and measure: the median of each, and the median of the per-round ratios (HTA /
kvscope) with a distribution-free interval for it (order statistics of the rounds; its
coverage is printed), plus the load average before and after. Goal: ≥ 5× whole process on
large traces.

Traces: the shared small ones (``../shared/data/kineto``), every ``--trace``, and with
``--make-trace N`` the trace that ``kvscope run --profile -n N`` writes for a real run of our
engine (N = 8 gives about 34 MB of JSON, 16 about 63 MB on this machine).

HTA (PyPI ``HolisticTraceAnalysis``, the ``bench`` extra: ``pip install -e '.[bench]'``) pulls
in Jupyter; without it (or without any trace) the benchmark says why and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchstats import child_env, median_interval

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "kineto"
SHARED_TRACES = ("sampled_rank-0.json.gz", "benchmark_result_2869224_1695835535_trace.json.gz")

_OURS_PROC = ("import sys; sys.path.insert(0, sys.argv[2]); from pathlib import Path; "
              "from analyzers.importers import load; load(Path(sys.argv[1]))")
_OURS_FRAMES_PROC = ("import sys; sys.path.insert(0, sys.argv[2]); from pathlib import Path; "
                     "from analyzers.importers import load; r = load(Path(sys.argv[1])); "
                     "r.requests, r.spans")
#: the DataFrames child with time marks: numpy + pyarrow, kvscope's modules, the load, pandas'
#: import, the frames (ms, printed on one line); `--phases` runs it after the timed rounds
_OURS_PHASES = ("import time; t = [time.perf_counter()]; import sys; "
                "sys.path.insert(0, sys.argv[2]); from pathlib import Path; "
                "import numpy, pyarrow; t.append(time.perf_counter()); "
                "from analyzers.importers import load, kineto; t.append(time.perf_counter()); "
                "r = load(Path(sys.argv[1])); t.append(time.perf_counter()); import pandas; "
                "t.append(time.perf_counter()); r.requests, r.spans; "
                "t.append(time.perf_counter()); "
                "print(*((b - a) * 1e3 for a, b in zip(t, t[1:]))); sys.stdout.flush()")
_PHASES = ("numpy+pyarrow import", "kvscope modules", "load", "pandas import", "frames")
_HTA_PROC = ("import logging, sys; logging.disable(logging.WARNING); "
             "from hta.trace_analysis import TraceAnalysis; TraceAnalysis(trace_dir=sys.argv[1])")


def _hta_dir(trace: Path, workdir: Path) -> Path:
    """A directory holding only `trace` (HTA reads a directory of per-rank traces); a symlink
    keeps the bytes identical."""
    d = workdir / f"hta-{abs(hash(str(trace)))}"
    d.mkdir(exist_ok=True)
    suffix = ".json.gz" if trace.name.endswith(".gz") else ".json"
    link = d / f"rank-0{suffix}"
    if not link.exists():
        os.symlink(trace.resolve(), link)
    return d


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _proc(argv: list[str], env: dict[str, str]) -> Callable[[], object]:
    def run() -> object:
        return subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)

    return run


def _child_env(work: Path) -> dict[str, str]:
    """The environment of the timed processes: both sides' modules from one bytecode cache
    (`benchstats.child_env`), filled by the warm-up runs."""
    return child_env(work / "pycache")


def _rounds(fns: list[Callable[[], object]], repeats: int) -> list[list[float]]:
    """Each of `fns` timed `repeats` times, in rounds: one call of each per round, every
    other round in reverse order. Returns the times per function, by round."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        order = list(range(len(fns)))
        for i in (order if r % 2 == 0 else order[::-1]):
            times[i].append(_time(fns[i]))
    return times


def _report(label: str, hta_s: list[float], ours_s: list[float]) -> float:
    ratios = [h / o for h, o in zip(hta_s, ours_s, strict=True)]
    lo, hi, cov = median_interval(ratios)
    med = statistics.median(ratios)
    print(f"  {label:28s}: HTA median {statistics.median(hta_s) * 1e3:8.1f} ms, kvscope median "
          f"{statistics.median(ours_s) * 1e3:8.1f} ms; HTA/kvscope per-round median {med:.1f}x "
          f"[{lo:.1f}x, {hi:.1f}x] ({cov:.0%} interval, {len(ratios)} rounds)")
    return med


def _print_phases(trace: Path, env: dict[str, str], repeats: int) -> None:
    """Where a kvscope DataFrames process spends its time: the marks of `_OURS_PHASES`, and the
    rest of the whole process (interpreter start and exit), medians over `repeats` runs."""
    runs: list[list[float]] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _OURS_PHASES, str(trace), str(REPO)],
                             check=True, capture_output=True, text=True, env=env).stdout
        whole = (time.perf_counter() - t0) * 1e3
        marks = [float(x) for x in out.split()]
        runs.append([*marks, whole - sum(marks)])
    med = [statistics.median(col) for col in zip(*runs, strict=True)]
    parts = ", ".join(f"{name} {ms:.0f}" for name, ms in
                      zip((*_PHASES, "interpreter start + exit"), med, strict=True))
    print(f"  {'kvscope DataFrames phases':28s}: {parts} ms (medians of {repeats} runs)")


def _make_trace(n: int, workdir: Path) -> Path:
    out = workdir / f"run-profile-{n}"
    subprocess.run([sys.executable, "-m", "kvscope.cli", "run", "--profile", "-n", str(n),
                    "--out", str(out)], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out / "profile" / "torch_trace.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed pairs per measure (default 7)")
    ap.add_argument("--trace", type=Path, action="append", default=[],
                    help="a Kineto .json(.gz) (repeatable)")
    ap.add_argument("--make-trace", type=int, action="append", default=[], metavar="N",
                    help="also benchmark the trace of `kvscope run --profile -n N` (repeatable)")
    ap.add_argument("--mode", choices=("both", "process", "inproc"), default="both")
    ap.add_argument("--no-shared", action="store_true", help="skip the shared small traces")
    ap.add_argument("--phases", action="store_true",
                    help="after the timed rounds, where a kvscope DataFrames process spends its "
                    "time (median of --repeats runs; not part of the figures)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    try:
        import hta  # noqa: F401
    except ImportError:
        print("skip: HolisticTraceAnalysis not installed "
              "(pip install -e '.[bench]': the benchmark-only extra)")
        return 0
    logging.disable(logging.WARNING)  # HTA logs every parse at INFO/WARNING
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-hta-") as d:
        work = Path(d)
        traces = [] if args.no_shared else [SHARED / t for t in SHARED_TRACES
                                             if (SHARED / t).exists()]
        traces += args.trace
        traces += [_make_trace(n, work) for n in args.make_trace]
        if not traces:
            print("skip: no trace (../shared/data is absent and none was given)")
            return 0
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              f"on {os.cpu_count()} CPUs")
        for trace in traces:
            _bench(trace, work, args.repeats, args.mode, args.phases)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def _bench(trace: Path, work: Path, repeats: int, mode: str, phases: bool = False
           ) -> None:
    from analyzers.importers import kineto, load

    hdir = _hta_dir(trace, work)
    parser = "msgspec typed decode" if kineto.msgspec is not None else "orjson/json"
    print(f"trace: {trace} ({trace.stat().st_size:,} bytes), kvscope parser: {parser}")
    if mode in ("both", "process"):
        env = _child_env(work)
        hta_p = _proc([sys.executable, "-c", _HTA_PROC, str(hdir)], env)
        ours_p = _proc([sys.executable, "-c", _OURS_PROC, str(trace), str(REPO)], env)
        ours_df = _proc([sys.executable, "-c", _OURS_FRAMES_PROC, str(trace), str(REPO)], env)
        for fn in (hta_p, ours_p, ours_df):  # warm-up: page cache, bytecode caches
            _time(fn)
        hta_s, ours_s, df_s = _rounds([hta_p, ours_p, ours_df], repeats)
        _report("whole process, Arrow tables", hta_s, ours_s)
        _report("whole process, DataFrames", hta_s, df_s)
        if phases:
            _print_phases(trace, env, repeats)
    if mode in ("both", "inproc"):
        from hta.trace_analysis import TraceAnalysis

        def hta_i() -> object:
            return TraceAnalysis(trace_dir=str(hdir))

        def ours_i() -> object:  # with its DataFrames: pandas is loaded here anyway
            r = load(trace)
            return r.requests, r.spans

        _time(hta_i)
        _time(ours_i)
        _report("in process", *_rounds([hta_i, ours_i], repeats))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
