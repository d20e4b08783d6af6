"""`kvscope analyze` reads a run projected (`REPORT_SPAN_COLUMNS`), without its step spans
(`REPORT_SPAN_FILTER`), and the step spans apart for the cost model: the report is the same,
byte for byte, as `build_report` over the whole store; and the pieces it is made of (the
Arrow step samples, the numpy summaries, the frame without steps) equal their pandas forms."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from agent.runstore import open_run
from agent.runstore.reader import read_table
from analyzers import costmodel
from analyzers.report import (
    REPORT_SPAN_COLUMNS,
    REPORT_SPAN_FILTER,
    STEP_SPAN_COLUMNS,
    build_report,
    render_json,
)
from analyzers.ttft import partition, summarize
from kvscope.session import RunOptions, run_session
from tests.conftest import GOLDEN_RUN


def _split_report(path: Path) -> str:
    store = open_run(path, columns={"spans": REPORT_SPAN_COLUMNS},
                     filters={"spans": REPORT_SPAN_FILTER})
    steps, _ = read_table(path, "spans", [], store.meta["schema_version"], store.meta,
                          columns=STEP_SPAN_COLUMNS, row_filter=~REPORT_SPAN_FILTER)
    return render_json(build_report(store, steps=steps))


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run with host and file:// tiers: ledger rows, transfers and step spans."""
    tmp = tmp_path_factory.mktemp("split")
    out = tmp / "run"
    run_session(RunOptions(out=out, model="tiny", metrics_port=0, collectors=False, threads=1,
                           seed=3, num_requests=16, rate=0, host_blocks=48,
                           remote=f"file://{tmp / 'remote'}"))
    return out


def test_the_split_read_gives_the_whole_report(engine_run: Path) -> None:
    whole = render_json(build_report(open_run(engine_run)))
    assert '"available": true' in whole  # the consistency check ran on the ledger
    assert _split_report(engine_run) == whole


@pytest.mark.parametrize("run", [GOLDEN_RUN, GOLDEN_RUN.parent / "run-v1"])
def test_the_split_read_gives_the_whole_report_on_the_golden_runs(run: Path) -> None:
    assert _split_report(run) == render_json(build_report(open_run(run)))


def test_the_frame_without_steps(engine_run: Path) -> None:
    store = open_run(engine_run)
    fast = store.frame_without("spans", "kind", "step")
    full = store.spans
    want = full.loc[full["kind"] != "step"].reset_index(drop=True)
    pd.testing.assert_frame_equal(fast, want)
    # Once the whole frame is built, the same rows come from it.
    pd.testing.assert_frame_equal(store.frame_without("spans", "kind", "step"), want)


def test_step_samples_from_arrow_equal_those_from_the_frame(engine_run: Path) -> None:
    store = open_run(engine_run)
    a = costmodel.step_samples(store.tables["spans"])
    b = costmodel.step_samples(store.spans)
    assert len(a[0])
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    # As JSON: an unfitted model's NaNs compare equal there.
    fits = [json.dumps(costmodel.fit_step_cost(x).to_dict())
            for x in (store.tables["spans"], store.spans)]
    assert fits[0] == fits[1]


def _reference_fit(tokens: np.ndarray, ns: np.ndarray, n_boot: int, seed: int = 0
                   ) -> tuple[float, float, np.ndarray]:
    """The bootstrap as first written: each resample built as arrays, then Theil-Sen."""
    def theil_sen(x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
        n = len(x)
        if n * (n - 1) // 2 <= costmodel._MAX_PAIRS:
            i, j = np.triu_indices(n, 1)
        else:
            i = rng.integers(0, n, costmodel._MAX_PAIRS)
            j = rng.integers(0, n, costmodel._MAX_PAIRS)
        dx = x[j] - x[i]
        keep = dx != 0
        slope = float(np.median((y[j] - y[i])[keep] / dx[keep]))
        return slope, float(np.median(y - slope * x))

    x = tokens.astype(np.float64)
    rng = np.random.default_rng(seed)
    slope, icpt = theil_sen(x, ns, rng)
    boots = np.empty((n_boot, 2))
    for b in range(n_boot):
        idx = rng.integers(0, len(x), len(x))
        boots[b] = theil_sen(x[idx], ns[idx], rng)
    return slope, icpt, boots


@pytest.mark.parametrize("n", [40, 300, 5000])
def test_the_bootstrap_without_resampled_arrays_is_the_same_bit_for_bit(n: int) -> None:
    rng = np.random.default_rng(n)
    tokens = rng.integers(1, 600, n)
    ns = (2e6 + 40_000 * tokens + rng.normal(0, 3e5, n)).round()
    slope, icpt, boots = _reference_fit(tokens, ns, n_boot=20)
    x = tokens.astype(np.float64)
    g = np.random.default_rng(0)
    assert costmodel._theil_sen(x, ns, g) == (slope, icpt)
    for b in range(20):
        assert costmodel._theil_sen(x, ns, g, g.integers(0, n, n)) == tuple(boots[b])


def test_the_whole_run_summary_equals_one_group_of_the_grouped_one(engine_run: Path) -> None:
    """The ungrouped tables come from numpy; grouping by a column every request shares goes
    through pandas' groupby: the figures are the same."""
    store = open_run(engine_run)
    part = partition(store.requests, store.spans)
    whole = summarize(part)
    one = summarize(part.assign(status="x"), by="status")
    pd.testing.assert_frame_equal(whole.stages, one.stages.drop(columns="status"))
    pd.testing.assert_frame_equal(whole.slowest, one.slowest.drop(columns="status"))


@pytest.mark.parametrize("seed", range(12))
def test_window_quantiles_equal_pandas_groupby(seed: int) -> None:
    from analyzers.ttft_summary import QUANTILES, _group_quantiles

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    v = rng.integers(0, [5, 10**9][seed % 2], n)
    g = rng.integers(0, 4, n)
    want = pd.DataFrame({"v": v}).groupby(g).quantile(list(QUANTILES))["v"]
    for k in np.unique(g):
        got = _group_quantiles(v[g == k])
        assert got == want.xs(k, level=0).tolist()
