"""Bootstrap confidence intervals for differences of quantiles, without materialising resamples.

A bootstrap resample of n values is n draws with replacement from the empirical distribution,
i.e. ``x_sorted[ceil(n * U) - 1]`` for iid uniforms U. Because that map is monotone, the k-th
smallest value of the resample is ``x_sorted[ceil(n * U_(k)) - 1]`` where ``U_(k)``, the k-th
smallest of n uniforms, is Beta(k, n - k + 1); the next order statistic is
``U_(k) + (1 - U_(k)) * Beta(1, n - k)``. So the bootstrap distribution of numpy's linear
quantile (which interpolates between two adjacent order statistics) is sampled exactly with two
Beta draws per replicate: O(n log n) for the sort and O(B) after it, instead of O(B * n).
"""

from __future__ import annotations

import numpy as np


def quantile_replicates(sorted_x: np.ndarray, q: float, n_boot: int,
                        rng: np.random.Generator) -> np.ndarray:
    """`n_boot` bootstrap replicates of ``np.quantile(x, q)`` (linear method).

    Args:
        sorted_x: the sample, sorted ascending (float or int).
        q: the quantile in [0, 1].
        n_boot: number of replicates.
        rng: the random generator (seeded by the caller for reproducibility).

    Returns:
        float64 array of `n_boot` replicates (NaN when the sample is empty).
    """
    n = len(sorted_x)
    if n == 0:
        return np.full(n_boot, np.nan)
    x = np.asarray(sorted_x, dtype=np.float64)
    if n == 1:
        return np.full(n_boot, x[0])
    h = (n - 1) * q
    j = min(int(np.floor(h)), n - 2)  # 0-based lower order statistic
    g = h - j
    u1 = rng.beta(j + 1, n - j, size=n_boot)  # U_(j+1), 1-based order
    u2 = u1 + (1.0 - u1) * rng.beta(1, n - j - 1, size=n_boot)
    i1 = np.clip(np.ceil(n * u1).astype(np.int64) - 1, 0, n - 1)
    i2 = np.clip(np.ceil(n * u2).astype(np.int64) - 1, 0, n - 1)
    lo, hi = x[i1], x[i2]
    # numpy's own lerp (from the upper end when g >= 0.5), so that every replicate is bit for
    # bit a value np.quantile could return.
    diff = hi - lo
    return np.where(g >= 0.5, hi - diff * (1.0 - g), lo + diff * g)


def quantile_delta_ci(a: np.ndarray, b: np.ndarray, q: float, *, n_boot: int = 2000,
                      level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Difference ``quantile(b, q) - quantile(a, q)`` with a percentile-bootstrap interval.

    Args:
        a, b: the two independent samples (unsorted).
        q: the quantile.
        n_boot: bootstrap replicates.
        level: confidence level of the interval.
        seed: seed of the generator (fixed: same inputs, same interval).

    Returns:
        ``(delta, low, high)``; NaNs when either sample is empty.
    """
    sa = np.sort(np.asarray(a, dtype=np.float64))
    sb = np.sort(np.asarray(b, dtype=np.float64))
    if not len(sa) or not len(sb):
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    reps = quantile_replicates(sb, q, n_boot, rng) - quantile_replicates(sa, q, n_boot, rng)
    alpha = (1.0 - level) / 2
    lo, hi = np.quantile(reps, [alpha, 1.0 - alpha])
    delta = float(np.quantile(sb, q) - np.quantile(sa, q))
    return delta, float(lo), float(hi)
