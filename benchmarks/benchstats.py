"""The statistics every benchmark prints: a distribution-free interval of a median (paired
ratios on a noisy machine), a t interval of a mean, and the load average beside them.

Imported by the `bench_*.py` scripts (their folder is on `sys.path` when they run).
"""

from __future__ import annotations

import math
import os
import statistics

#: Student t quantiles (0.975) by degrees of freedom; 1.96 beyond the table.
_T975 = {9: 2.262, 19: 2.093, 29: 2.045, 39: 2.023, 49: 2.010, 59: 2.001, 79: 1.990,
         99: 1.984, 119: 1.980}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def median_interval(values: list[float], conf: float = 0.95) -> tuple[float, float, float]:
    """(low, high, coverage): the order-statistics interval for the median of `values` with
    coverage >= `conf` when the sample allows it, else the full range and its coverage."""
    v = sorted(values)
    n = len(v)

    def cover(k: int) -> float:  # P(x_(k) <= median <= x_(n-k+1)), k 1-based
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= n // 2 and cover(k + 1) >= conf:
        k += 1
    return v[k - 1], v[n - k], cover(k)


def median_ci(values: list[float], conf: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high) with `median_interval`'s bounds."""
    lo, hi, _ = median_interval(values, conf)
    return statistics.median(values), lo, hi


def t975(df: int) -> float:
    for k in sorted(_T975):
        if df <= k:
            return _T975[k]
    return 1.96


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval."""
    return statistics.fmean(xs), t975(len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5


def child_env(cache_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The environment for a benchmark's timed child processes: modules load from bytecode
    caches (all in `cache_dir`, filled by the warm-up runs), as an installed package's do.
    With PYTHONDONTWRITEBYTECODE set (this workplace sets it) a source tree's modules would be
    compiled in every process, while a baseline's site-packages load precompiled."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(cache_dir)
    return env
