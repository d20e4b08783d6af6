"""The whole-run summaries' numpy paths (windows' quantiles for all windows at once, the
tables built with their float ns columns rounded) give exactly the frames the pandas paths
give: random partitions with windows of one request, ties, zeros and large values."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from agent.schema import TTFT_STAGES
from analyzers import ttft_summary as S
from analyzers.frames import STAGE_COLUMNS


def _part(rng: np.random.Generator, n: int) -> pd.DataFrame:
    stage = rng.integers(0, 5_000_000, size=(n, len(TTFT_STAGES)))
    stage[rng.random((n, len(TTFT_STAGES))) < 0.3] = 0
    if n > 3:
        stage[:3] = stage[3]  # ties
    stage[0, 0] = 2**40  # a large one
    ttft = stage.sum(axis=1)
    # Arrivals in bursts: some windows hold one request.
    arrival = 10**12 + np.sort(rng.choice(np.r_[rng.integers(0, 10**6, n),
                                                rng.integers(10**9, 5 * 10**9, n)], n))
    data: dict[str, object] = {"arrival_ns": arrival}
    for j, c in enumerate(STAGE_COLUMNS):
        data[c] = pd.array(stage[:, j], dtype="Int64")
    data["ttft_ns"] = pd.array(ttft, dtype="Int64")
    data["hidden_load_ns"] = pd.array(rng.integers(0, 10**6, n), dtype="Int64")
    data["derived"] = np.zeros(n, bool)
    data["violation"] = pd.array([None] * n, dtype="str")
    return pd.DataFrame(data)


@pytest.mark.parametrize("seed,n", [(0, 1), (1, 2), (2, 17), (3, 500), (4, 3000)])
def test_numpy_windows_equal_the_pandas_path(seed: int, n: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    part = _part(np.random.default_rng(seed), n)
    fast = S.summarize(part, window_ns=10**8)
    monkeypatch.setattr(S, "_NUMPY_WINDOWS", 0)
    slow = S.summarize(part, window_ns=10**8)
    assert len(fast.windows) > 1 or n < 3
    pd.testing.assert_frame_equal(fast.windows, slow.windows, check_exact=True)


@pytest.mark.parametrize("seed,n", [(5, 1), (6, 40), (7, 2000)])
def test_tables_equal_the_frames_tidied(seed: int, n: int) -> None:
    part = _part(np.random.default_rng(seed), n)
    vals = S._values(part)
    names = [*TTFT_STAGES, *S.EXTRA_ROWS]
    keys = [pd.Series("all", index=vals.index)]
    pd.testing.assert_frame_equal(S._stage_table(vals, keys, names, ()),
                                  S._tidy(S._stage_table(vals, keys, names, ("x",))
                                          .drop(columns="x")),
                                  check_exact=False, rtol=1e-12, check_dtype=True)
    data = {"a_ns": np.array([0.1 + 0.2, 5596000.000000001]), "n": np.array([1, 2]),
            "s": ["x", "y"], "b_ns": np.array([3, 4])}
    pd.testing.assert_frame_equal(S._table(data), S._tidy(pd.DataFrame(data)),
                                  check_exact=True)


@pytest.mark.parametrize("m", [1, 2, 3, 10, 101, 1000, 4097])
def test_quantiles_of_rows_partitioned_at_their_positions_equal_the_sorted(m: int) -> None:
    """`sorted_quantiles` of rows partitioned at `quantile_positions` (the summary's path)
    equals it of the rows sorted, and np.quantile, to the last bit (ties, extremes)."""
    rng = np.random.default_rng(m)
    x = np.stack([rng.integers(0, 10**9, m), rng.integers(0, 3, m), np.full(m, 7),
                  -rng.integers(0, 10**12, m)]).astype(np.int64)
    for qs in (S.QUANTILES, (0.0, 1.0), (0.25, 0.5, 0.75, 0.99, 0.999)):
        part = np.partition(x, S.quantile_positions(m, qs), axis=1)
        got = S.sorted_quantiles(part, qs)
        assert np.array_equal(got, S.sorted_quantiles(np.sort(x, axis=1), qs))
        assert np.array_equal(got, np.quantile(x, qs, axis=1))
