"""The order-statistic bootstrap equals resampling in distribution, and is reproducible."""

from __future__ import annotations

import numpy as np
import pytest

from analyzers.bootstrap import quantile_delta_ci, quantile_replicates


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_replicates_have_the_distribution_of_resampled_quantiles(q: float) -> None:
    x = np.sort(np.random.default_rng(1).lognormal(0.0, 1.0, 40))
    fast = quantile_replicates(x, q, 40_000, np.random.default_rng(2))
    idx = np.random.default_rng(3).integers(0, len(x), (40_000, len(x)))
    naive = np.quantile(x[idx], q, axis=1)
    # Two-sample Kolmogorov-Smirnov distance between the replicate distributions; with
    # 40k draws each, sampling noise alone keeps it under ~0.012 (99.9 %).
    grid = np.union1d(fast, naive)
    cdf_f = np.searchsorted(np.sort(fast), grid, side="right") / len(fast)
    cdf_n = np.searchsorted(np.sort(naive), grid, side="right") / len(naive)
    assert np.max(np.abs(cdf_f - cdf_n)) < 0.015
    # ...whereas a wrong order statistic (off by one) is far away.
    shifted = quantile_replicates(np.r_[x[1:], x[-1]], q, 40_000, np.random.default_rng(2))
    cdf_s = np.searchsorted(np.sort(shifted), grid, side="right") / len(shifted)
    assert np.max(np.abs(cdf_s - cdf_n)) > 0.05


def test_delta_interval_is_reproducible_and_covers_a_known_shift() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(100.0, 10.0, 2000)
    b = rng.normal(130.0, 10.0, 2000)
    d1 = quantile_delta_ci(a, b, 0.5, seed=7)
    assert d1 == quantile_delta_ci(a, b, 0.5, seed=7)
    delta, lo, hi = d1
    assert delta == np.quantile(b, 0.5) - np.quantile(a, 0.5)
    assert lo < delta < hi and lo < 30.0 < hi and lo > 25.0


def test_degenerate_samples() -> None:
    assert np.isnan(quantile_delta_ci([], [1.0], 0.5)[0])
    assert quantile_delta_ci([5.0], [7.0], 0.99) == (2.0, 2.0, 2.0)
    assert (quantile_replicates(np.array([3.0]), 0.5, 4, np.random.default_rng(0)) == 3.0).all()
